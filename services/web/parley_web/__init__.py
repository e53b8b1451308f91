"""The web connector: a chat page and an OpenAI-compatible chat completions API over the bus."""
