"""Anthropic's Messages API over chat completions: ``/v1/messages`` and
``/v1/messages/count_tokens`` (request bodies, translation to chat, the message and its
events, Anthropic's error shape, handler, routes)."""
