"""OpenAI's completions API: ``POST /v1/completions`` (request body, handler, route),
and beam search (`beam`), which chat completions run too."""
