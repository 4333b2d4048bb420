"""HTTP plumbing every role shares: the app factory, its state, errors, SSE responses, auth and drain."""
