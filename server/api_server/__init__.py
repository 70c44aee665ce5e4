"""The API server process: the FastAPI app factory (every API's routes registered,
error handlers, middleware), the `serve` flags, launch under uvicorn, the SIGTERM
drain, TLS certificate refresh and the header-count limit.

The one layer that imports the API folders (chat, completions, responses, messages,
decisions, pooling, batch, dev); nothing below imports it."""
