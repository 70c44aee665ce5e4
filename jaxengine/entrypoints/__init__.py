"""Offline `LLM` and the async engine the server uses (the engine issue builds them)."""
