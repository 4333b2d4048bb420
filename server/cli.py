"""`llm-fleet serve`: the OpenAI-compatible server in one of four roles."""

from __future__ import annotations

HELP = "serve a model over the OpenAI API (roles: colocated, prefill, decode, router)"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="builtin:tiny", help="builtin:tiny, builtin:small or a local HF model dir")
    parser.add_argument("--config", help="engine config YAML, watched and applied live")
    parser.add_argument("--role", default="colocated", choices=["colocated", "prefill", "decode", "router"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="model id in the API (default: the --model value)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish streams on SIGTERM")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--log-level", default="info")


def run(args) -> int:
    from .api.serve import serve

    return serve(args)
