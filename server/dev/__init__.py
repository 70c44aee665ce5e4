"""vLLM's routes beyond the APIs: the development routes (sleep, pause, weight updates,
collective RPC, with ``VLLM_SERVER_DEV_MODE``) and the extra routes (/tokenizer_info,
SageMaker's /invocations and /ping)."""
