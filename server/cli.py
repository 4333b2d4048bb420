"""`llm-fleet serve`: the OpenAI-compatible server in one of four roles."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from llmfleet.arguments import (
    LOG_LEVELS,
    bind_problem,
    configure_logging,
    non_negative,
    port,
    port_or_off,
    positive,
    positive_int,
)
from llmfleet.server.core.model_uri import HubModel, hub_reference
from llmfleet.server.engine_flags import add_engine_flags, add_vllm_flags, no_effect_note
from llmfleet.server.http.auth import api_keys
from llmfleet.server.http.body_guard import DEFAULT_MAX_BODY_MB
from llmfleet.server.parsers.reasoning import REASONING_PARSERS
from llmfleet.server.parsers.tools import TOOL_CALL_PARSERS
from llmfleet.server.router.policies import POLICIES as ROUTER_POLICIES
from llmfleet.server.wire.auth import API_KEY_ENV, KV_TOKEN_ENV

HELP = "serve a model over the OpenAI API (roles: colocated, prefill, decode, router)"
DEFAULT_MODEL = "builtin:tiny"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_arguments(parser) -> None:
    parser.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="as vLLM's `vllm serve MODEL`: the same as --model"
    )
    parser.add_argument(
        "--model",
        help="builtin:tiny (the default), builtin:small, a local HF model dir, or a Hugging Face repository "
        "(org/name or hf://org/name@revision), downloaded into --download-dir on first use",
    )
    parser.add_argument(
        "--download-dir",
        help="as vLLM's: the cache Hub models are downloaded into and loaded from (default: $HF_HUB_CACHE, "
        "~/.cache/huggingface/hub)",
    )
    parser.add_argument("--config", help="engine config YAML, watched and applied live")
    parser.add_argument("--role", default="colocated", choices=["colocated", "prefill", "decode", "router"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=8000)
    parser.add_argument(
        "--metrics-port",
        type=port_or_off,
        default=0,
        help="also serve /metrics, /load, the probes and /version (only those) on this port; 0: none",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="as vLLM's: the model ids requests may name; answers and metrics carry the first (default: --model)",
    )
    parser.add_argument("--drain-timeout", type=non_negative, default=30.0, help="seconds to finish streams on SIGTERM")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    parser.add_argument(
        "--api-key",
        nargs="+",
        metavar="KEY",
        action=_APIKeys,
        default=api_keys([os.environ.get(API_KEY_ENV)]),
        help=f"as vLLM's: /v1 paths need 'Authorization: Bearer <key>', any of the keys given (default: "
        f"${API_KEY_ENV}); put MODEL first, or it reads as a key",
    )
    parser.add_argument(
        "--max-request-body-mb",
        type=positive,
        default=DEFAULT_MAX_BODY_MB,
        help=f"larger request bodies get 413 before more of them is read (default {DEFAULT_MAX_BODY_MB:g})",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="as vLLM's: serve tool_choice 'auto' (the default with tools), reading calls with --tool-call-parser",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        help="the model's tool-call format: hermes (Hermes, Qwen 2.5/3), llama3_json (Llama 3.1+), pythonic "
        "(Llama 3.2/4) or mistral (Mistral 7B v0.3, Nemo, Small)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="as vLLM's: chat replies carry the model's <think> text as reasoning_content: deepseek_r1 "
        "(R1, its distills, QwQ) or qwen3",
    )
    for key, dest, what in (
        (
            "enable_in_reasoning",
            "structured_outputs_in_reasoning",
            "with --reasoning-parser, a structured-output grammar (or a forced tool call) holds the thinking "
            "too; by default it holds the answer after </think>",
        ),
        (
            "disable_any_whitespace",
            "structured_outputs_compact",
            "JSON held to a schema (response_format, structured_outputs, guided_json, a required or named "
            "tool call) comes compact, with no whitespace between its tokens, unless the request gives a "
            "whitespace_pattern; a weak model then cannot spend its tokens on newlines",
        ),
    ):  # vLLM's dotted switches of its StructuredOutputsConfig: the flag alone, or =true|false
        parser.add_argument(
            f"--structured-outputs-config.{key}",
            dest=dest,
            type=boolean,
            nargs="?",
            const=True,
            default=False,
            metavar="true|false",
            help=f"as vLLM's: {what}",
        )
    parser.add_argument(
        "--chat-template",
        help="as vLLM's: the chat template, a file or the Jinja text itself, in place of the tokenizer's own",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="as vLLM's: where a request's missing temperature, top_p, top_k, min_p, repetition_penalty and "
        "(chat) max_tokens come from: auto, the model's generation_config.json (the default); vllm, none "
        "(the API's neutral values); or a folder holding one",
    )
    parser.add_argument(
        "--override-generation-config",
        metavar="JSON",
        help="as vLLM's: generation config keys over --generation-config's, e.g. '{\"temperature\": 0.5}'",
    )
    add_engine_flags(parser)
    add_vllm_http_flags(add_vllm_flags(parser))
    distributed = parser.add_argument_group("parallel workers over several nodes (torchrun's names)")
    distributed.add_argument("--nnodes", type=positive_int, default=1, help="nodes the model's workers span")
    distributed.add_argument("--node-rank", type=int, default=0, help="this node's place: 0 serves the API")
    distributed.add_argument(
        "--master-addr", default="127.0.0.1", help="the node-rank 0 server's address, where the workers meet"
    )
    distributed.add_argument(
        "--master-port", type=port, help="the port they meet on (default: a free one, on a single node)"
    )
    distributed.add_argument(
        "--headless",
        action="store_true",
        help="as vLLM's: run this node's model workers only, no API (GET /health on --port)",
    )
    prefill = parser.add_argument_group("prefill role")
    prefill.add_argument(
        "--kv-export-ttl",
        type=positive,
        default=60.0,
        help="seconds computed KV waits for a decode server to fetch it (default 60)",
    )
    prefill.add_argument(
        "--kv-export-limit-mb",
        type=positive,
        default=2048,
        help="host memory for KV waiting to be fetched; the oldest goes first (default 2048)",
    )
    transfer = parser.add_argument_group("KV transfer (prefill, decode and router roles)")
    transfer.add_argument(
        "--insecure-kv-transfer",
        action="store_true",
        help=f"serve the prefill or decode role without ${KV_TOKEN_ENV}: anyone who reaches a server may then "
        "use its transfer paths, and KV bodies carry no secret MAC (refused without this flag)",
    )
    transfer.add_argument(
        "--prefill-host",
        metavar="HOST:PORT",
        help="decode role: the prefill servers are the addresses HOST resolves to (the prefill pool's "
        "headless Service), each at PORT",
    )
    router = parser.add_argument_group("router role (and the decode role's prefill servers)")
    router.add_argument("--colocated-url", action="append", help="a colocated server (repeatable)")
    router.add_argument(
        "--prefill-url",
        action="append",
        help="a prefill server (repeatable); on a decode server, one it may fetch KV from (it fetches from no other)",
    )
    router.add_argument("--decode-url", action="append", help="a decode server (repeatable)")
    router.add_argument(
        "--endpoints-file",
        help="YAML {colocated: [url]} or {prefill: [url], decode: [url]}, re-read when it changes "
        "(a decode server reads its prefill list)",
    )
    router.add_argument(
        "--router-mode",
        choices=["colocated", "disaggregated"],
        default="disaggregated",
        help="which pools --endpoints-file names (the other flags say it themselves)",
    )
    router.add_argument("--colocated-service", help="Kubernetes Service of the colocated pods (EndpointSlices)")
    router.add_argument("--prefill-service", help="Kubernetes Service of the prefill pods (EndpointSlices)")
    router.add_argument("--decode-service", help="Kubernetes Service of the decode pods (EndpointSlices)")
    router.add_argument("--kube-api", help="Kubernetes API URL without credentials (default: in-cluster)")
    router.add_argument(
        "--hold-timeout",
        type=non_negative,
        default=0.0,
        help="seconds a request waits for a server while its pool has none (scaled to zero, a rollout's gap); "
        "0 (the default): a 503 at once",
    )
    router.add_argument(
        "--max-held", type=positive_int, default=256, help="requests held at once; more get a 503 (default 256)"
    )
    router.add_argument(
        "--wake-config-map",
        metavar="NAME",
        help="ask for servers while holding by stamping llmfleet.io/wake-requested-at on this ConfigMap "
        "(the operator's wake request)",
    )
    router.add_argument(
        "--router-policy",
        default="load",
        choices=sorted(ROUTER_POLICIES),
        help="load: least loaded; prefix: the server that took the longest prefix of the prompt, while "
        "its load is within 2 queued requests of the least loaded (its prefix cache hits)",
    )
    router.add_argument(
        "--prefill-timeout",
        type=positive,
        default=120.0,
        help="seconds to wait for a prefill server's answer before trying another",
    )
    router.add_argument(
        "--decode-timeout",
        type=positive,
        default=120.0,
        help="seconds to wait for a decode server's next byte of a stream (a whole "
        "answer is waited for while the server answers its /load polls)",
    )


def add_vllm_http_flags(group) -> None:
    """The vLLM flags llm-fleet acts on (the others are engine_flags.VLLM_FLAGS)."""
    group.add_argument(
        "--revision",
        help="a Hub model's branch, tag or commit (the same as MODEL@REVISION); no effect on a local model",
    )
    group.add_argument(
        "--tokenizer",
        help="refused unless it names the model itself: llm-fleet loads the tokenizer from the model's own files",
    )
    group.add_argument(
        "--allowed-origins",
        type=json_list,
        metavar="JSON",
        help="CORS: the origins browsers may call from, a JSON list ('[\"https://app.example.com\"]' or "
        "'[\"*\"]'); without it no CORS headers are sent",
    )
    group.add_argument(
        "--allowed-methods", type=json_list, default=["*"], metavar="JSON", help="CORS: with --allowed-origins"
    )
    group.add_argument(
        "--allowed-headers", type=json_list, default=["*"], metavar="JSON", help="CORS: with --allowed-origins"
    )
    group.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CORS: with --allowed-origins, browsers may send cookies and Authorization",
    )
    group.add_argument("--root-path", help="the path prefix a proxy serves this server under")
    group.add_argument(
        "--uvicorn-log-level",
        type=str.lower,
        choices=UVICORN_LOG_LEVELS,
        help="uvicorn's log level (default: --log-level)",
    )
    group.add_argument(
        "--enable-request-id-headers",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="answers carry X-Request-Id: the request's own, else a new one",
    )


class _APIKeys(argparse.Action):
    """``--api-key`` as vLLM takes it: one key or several, as a tuple (empty ones dropped)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, api_keys(values))


def json_list(text: str) -> list[str]:
    """vLLM's CORS flags: a JSON list of strings."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r} (e.g. '[\"https://a.example\"]')")
    return value


def run(args) -> int:
    if args.model_tag and args.model and args.model_tag != args.model:
        print(f"llm-fleet serve: two models given: {args.model_tag} and --model {args.model}", file=sys.stderr)
        return 2
    args.model = args.model_tag or args.model or DEFAULT_MODEL
    unused = []  # vLLM flags given that change nothing here, beyond engine_flags.VLLM_FLAGS
    if args.role != "router":
        try:
            args.model, unused_revision = with_revision(args.model, args.revision)
        except ValueError as exc:
            print(f"llm-fleet serve: {exc}", file=sys.stderr)
            return 2
        unused += filter(None, [unused_revision])
        if args.tokenizer not in (None, "", "None") and model_identity(args.tokenizer) != model_identity(args.model):
            print(
                f"llm-fleet serve: --tokenizer {args.tokenizer}: llm-fleet loads the tokenizer from the model's "
                f"own files ({args.model}); a different one is not supported",
                file=sys.stderr,
            )
            return 2
    for listen in (args.port, args.metrics_port):
        problem = listen and bind_problem(args.host, listen)
        if problem:
            print(f"llm-fleet serve: cannot listen on {args.host}:{listen}: {problem}", file=sys.stderr)
            return 2
    if args.metrics_port == args.port:
        print("llm-fleet serve: --metrics-port must differ from --port", file=sys.stderr)
        return 2
    problem = distributed_problem(args)
    if problem:
        print(f"llm-fleet serve: {problem}", file=sys.stderr)
        return 2
    note = no_effect_note(args, unused)
    if note:
        configure_logging(args.log_level)  # the role's own call then keeps it
        logging.getLogger("llmfleet.serve").info("%s", note)
    if args.role == "router":
        from llmfleet.server.router.serve import serve as serve_router

        return serve_router(args)
    if args.headless:
        from llmfleet.server.parallel.headless import serve_headless

        return serve_headless(args)
    from llmfleet.server.serve import serve

    return serve(args)


def with_revision(model: str, revision: str | None) -> tuple[str, str | None]:
    """``--revision`` folded into a Hub model (``hf://org/name@revision``), and where it changes
    nothing (a built-in or a local model) the flag and why; ValueError: a bad one, or two revisions."""
    if not revision:
        return model, None
    hub = None if Path(model).expanduser().exists() else hub_reference(model)
    if hub is None:
        return model, f"--revision {revision} ({model} is no Hub repository)"
    if hub.revision not in (None, revision):
        raise ValueError(f"two revisions given: {model} and --revision {revision}")
    reference = HubModel(hub.repo_id, revision)
    hub_reference(str(reference))  # checks the revision's spelling
    return str(reference), None


def model_identity(model: str) -> object:
    """What ``model`` names, for telling whether two spellings name one model: a local directory,
    else a Hub repository (whatever its revision), else the text."""
    path = Path(model).expanduser()
    if path.exists():
        return path.resolve()
    try:
        hub = hub_reference(model)
    except ValueError:
        hub = None
    return hub.repo_id if hub is not None else model


def distributed_problem(args) -> str | None:
    """What is wrong with the flags that place this server among several nodes, or None."""
    if args.nnodes == 1:
        if args.headless or args.node_rank:
            return "--headless and --node-rank need --nnodes of 2 or more"
        return None
    if args.master_port is None:
        return "--nnodes of 2 or more needs --master-port (and --master-addr: the node-rank 0 server)"
    if not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank must be from 0 to {args.nnodes - 1}"
    if args.headless != (args.node_rank > 0):
        return "node-rank 0 serves the API; every other node runs --headless"
    return None


def boolean(text: str) -> bool:
    """A boolean flag's value as vLLM's dotted config flags take it (``=True``, ``=false``)."""
    value = text.strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise ValueError(text)  # argparse reports it as an invalid value
    return value in ("true", "1")
