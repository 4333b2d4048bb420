"""The router role: the client-facing OpenAI endpoint of a disaggregated fleet (no engine, no torch)."""
