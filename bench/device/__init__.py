"""`python -m bench.device`: one command that checks a GPU end to end.

Sections, each with a time budget, each printed as a table and all saved to one JSON
file (written after every item, so a run cut short keeps what it measured):
`environment` (versions, devices, copy bandwidth, bf16 matmul rate), `correctness`
(the ``gpu``-marked kernel tests, tiny Llama / Qwen3 / Gemma 3 models against
transformers), `kernels` (attention against the copy bandwidth and the matmul rate)
and `engine` (a Llama-3-8B-shaped engine: decode, throughput, TTFT, start-up,
compilations after warm-up, and its variants). ``--dry-run`` runs the same on CPU at
tiny sizes (`profile.DRY_RUN`). See bench/README.md, "One command on a GPU".
"""
