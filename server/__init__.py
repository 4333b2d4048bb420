"""llm-fleet inference server: engine, runners and the OpenAI-compatible API."""
