"""llm-fleet Kubernetes operator (kopf): reconciles InferenceService resources and tunes them."""
