"""A chat rendered for the engine and its output read back, shared by every API that
runs over chat (chat completions, Responses, Anthropic Messages, Decisions): messages
as the template gets them, image parts loaded, a choice's text parsed into reasoning,
content and tool calls, and gpt-oss's harmony format both ways."""
