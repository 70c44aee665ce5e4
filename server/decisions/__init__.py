"""OpenAI's Decisions API (vLLM's): ``POST /v1/decisions``, answers read from
next-token logprobs over chat (request and questions, prompts, answers, handler,
route)."""
