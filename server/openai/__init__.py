"""The OpenAI endpoints of an engine-backed server: request models, submission to the engine, tools,
structured output, the Responses API and the KV-transfer endpoints of disaggregated serving."""
