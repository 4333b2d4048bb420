"""llm-fleet: LLM inference fleets that hold their latency SLOs at the lowest cost."""

__version__ = "0.1.0"
