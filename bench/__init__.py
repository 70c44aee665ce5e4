"""The repository's benchmark scripts (not installed; run from a checkout).

What `jaxengine bench` runs (serve, throughput, latency and their helpers) ships
inside the package, in `jaxengine.benchmarks`; the scripts here (kernels, startup,
embed, spec_decode, serve_peers, ...) import from there. See bench/README.md for
the commands and the latest measured numbers.
"""
