"""The benchmarks `jaxengine bench` runs, shipped with the package.

`throughput` and `latency` run the same token-id workload on jaxengine and its
peers (transformers, llama.cpp) in one process, one peer after another, and print
one table with ratios against transformers; `serve` is the client-side serving
benchmark against a running API server (`serve_datasets`, `serve_client`,
`serve_metrics`). Each is also runnable as ``python -m jaxengine.benchmarks.X``.
The repository's other benchmark scripts live in ``bench/`` (not installed) and
import from here. See bench/README.md for the commands and measured numbers.
"""
