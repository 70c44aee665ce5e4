"""Offline benchmarks of jaxengine with its peers (transformers, llama.cpp) side by side.

`bench.throughput` and `bench.latency` run the same token-id workload on every peer in
one process, one peer after another, and print one table with ratios against
transformers; see bench/README.md for the commands and the latest measured numbers.
"""
