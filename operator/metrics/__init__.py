"""Metric sources: what the tuner reads about each pool, from Prometheus or from the pods directly."""
