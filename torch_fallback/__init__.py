"""Running architectures or paths that have no JAX implementation, through torch."""
