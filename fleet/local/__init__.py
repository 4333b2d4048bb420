"""The local fleet: run an InferenceService file on one machine, no cluster."""
