"""OpenAI's Responses API over chat completions: ``/v1/responses`` (request body, the
request as chat, the Response object and its events, the store, handler, routes)."""
