"""`python -m bench.device`: one command that checks a GPU end to end.

Sections, each with a time budget, each printed as a table and all saved to one JSON
file (written after every item, so a run cut short keeps what it measured):
`environment` (versions, devices, the vendor's sheet, copy and read bandwidth, bf16
matmul rate), `correctness`
(the ``gpu``-marked kernel tests, tiny Llama / Qwen3 / Gemma 3 models against
transformers), `kernels` (attention against the copy bandwidth and the matmul rate)
`engine` (a Llama-3-8B-shaped engine: decode, throughput, TTFT, start-up,
compilations after warm-up, its variants, and a profiler trace of its steps read into
a table by `trace`) and `peer` (transformers' Llama at the same shape on torch, with
jaxengine's speed over it). ``--dry-run`` runs the same on CPU at
tiny sizes (`profile.DRY_RUN`). See bench/README.md, "One command on a GPU".
"""
