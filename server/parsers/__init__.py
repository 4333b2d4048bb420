"""Text parsers for model output: tool calls and reasoning, as vLLM names them (pure text in, parts out)."""
