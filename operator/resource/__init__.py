"""The InferenceService resource as data: its spec, its CRD schema, its file form and the tuner state it carries."""
