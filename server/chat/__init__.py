"""OpenAI's chat completions API: ``POST /v1/chat/completions`` (request body,
handler, route). Responses, Messages, Decisions and batch chat run over its
`ChatHandler`."""
