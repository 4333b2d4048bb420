"""What passes between our processes and their clients, below any web framework: SSE framing,
OpenAI-style error bodies, auth headers and environment names, keep-alive settings, a client that
left, a parent that died. The local fleet and the router share these without the server's app."""
