"""Attention kernels for jaxengine.

Each kernel lives in its own package with a pure-jnp reference of the same signature
(`reference.py`). CPU runs the reference; tests compare Pallas kernels (interpret mode
on CPU) against it; GPU and TPU run the kernels.
"""
