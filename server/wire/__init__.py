"""What crosses the network between our processes, below any web framework: SSE framing, auth
headers and environment names, keep-alive settings, noticing a client that left."""
