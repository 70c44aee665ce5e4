"""Batches: OpenAI's batch file format run offline through the same handlers
(`run_batch`, `jaxengine run-batch`) and ``POST /v1/chat/completions/batch``
(`chat`, `routes`)."""
