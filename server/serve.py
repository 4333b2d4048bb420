"""Process wiring for `llm-fleet serve`: engine, metrics, config watcher, app, uvicorn, drain.

Roles with a local engine (colocated, prefill, decode) share :func:`local_engine_state`; every
role, the router included (``llmfleet.server.router.serve``), runs its app through
:func:`llmfleet.server.http.drain.run_app`, which gives it the SIGTERM drain and exit code 0.
"""

from __future__ import annotations

import logging
from pathlib import Path

from llmfleet.arguments import configure_logging
from llmfleet.server.config import file_overrides, load_engine_config, read_engine_file
from llmfleet.server.core.chat_template import holds_jinja, template_problem
from llmfleet.server.core.model_uri import hub_reference
from llmfleet.server.engine.build import LOAD_ERRORS, build_engine
from llmfleet.server.engine_flags import FLAGS, SWITCHES, engine_flags
from llmfleet.server.http.app import add_vllm_http_flags
from llmfleet.server.http.drain import run_app
from llmfleet.server.http.kv_store import KVExportStore
from llmfleet.server.http.prefill_peers import PrefillPeers
from llmfleet.server.http.state import ServerState
from llmfleet.server.live_config import ConfigWatcher, version_of
from llmfleet.server.openai.app import create_app
from llmfleet.server.openai.generation_defaults import GenerationConfigError, read_generation_defaults
from llmfleet.server.runner.builtin_models import download_if_hub, resolve_model
from llmfleet.server.wire.auth import KV_TOKEN_ENV, kv_token_from_env
from llmfleet.server.wire.endpoints import EndpointsFile, EndpointSource, ServiceDNS, StaticEndpoints

log = logging.getLogger(__name__)


def local_engine_state(args) -> tuple[ServerState, ConfigWatcher | None]:
    """Load the model, start the engine thread and, with ``--config``, the live-config watcher."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("llm-fleet serve: --enable-auto-tool-choice needs --tool-call-parser")
    # before the model loads: a refusal takes a second, not a load
    token = transfer_token(args)
    peers = PrefillPeers(prefill_source(args)) if args.role == "decode" else None
    template = read_chat_template(args.chat_template) if args.chat_template else None
    flags = engine_flags(args)
    loaded = version_of(args.config) if args.config else None  # before reading it: see ConfigWatcher
    try:
        config = load_engine_config(args.config, flags)
    except ValueError as exc:  # a bad file at start-up has no last good config to fall back on
        raise SystemExit(f"llm-fleet serve: {exc}") from exc
    if args.config:
        warn_of_overridden_flags(args.config, flags)
    try:
        # once: a Hub model is downloaded (or found in the cache) here, then loaded from disk
        model = download_if_hub(args.model, getattr(args, "download_dir", None))
        engine, tokenizer = build_engine(model, config, device=args.device, distributed=distributed_args(args))
    except LOAD_ERRORS as exc:
        raise SystemExit(f"llm-fleet serve: cannot load {args.model}: {exc}") from exc
    if template is not None:
        tokenizer.chat_template = template
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        from llmfleet.server.parallel.runner import leave_cores_to_workers

        leave_cores_to_workers()
    try:
        defaults = read_generation_defaults(
            args.generation_config, resolve_model(model), args.override_generation_config
        )
    except GenerationConfigError as exc:
        raise SystemExit(f"llm-fleet serve: {exc}") from exc
    if defaults:
        log.info("requests that leave them out get the generation config's %s", defaults)
    name, *aliases = args.served_model_name or [served_name(args.model)]
    state = ServerState.for_engine(engine, tokenizer, name, args.role)
    state.model_aliases = tuple(aliases)
    state.api_keys = args.api_key
    state.max_body_bytes = int(args.max_request_body_mb * 2**20)
    state.kv_token = token
    state.prefill_peers = peers
    if peers is not None:
        log.info("KV is fetched only from the prefill servers of %s", peers.description)
    state.tool_call_parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    state.reasoning_parser = args.reasoning_parser
    state.structured_outputs_in_reasoning = args.structured_outputs_in_reasoning
    state.structured_outputs_compact = args.structured_outputs_compact
    state.sampling_defaults = defaults
    if args.role == "prefill":
        state.kv_store = KVExportStore(ttl_s=args.kv_export_ttl, limit_bytes=int(args.kv_export_limit_mb * 2**20))
    watcher = None
    if args.config:
        watcher = ConfigWatcher.for_engine(
            args.config, state.engine, state.metrics, initial=config, defaults=flags, baseline=loaded
        )
        watcher.start()
    return state, watcher


def distributed_args(args) -> dict:
    """Where a parallel model's workers meet (ParallelRunner's keywords)."""
    return {
        "nnodes": getattr(args, "nnodes", 1),
        "master_addr": getattr(args, "master_addr", "127.0.0.1"),
        "master_port": getattr(args, "master_port", None),
    }


def transfer_token(args) -> str | None:
    """The fleet's KV-transfer token. The prefill and decode roles refuse to start without one,
    unless told to with ``--insecure-kv-transfer``: without it anyone who reaches them may hand a
    decode server KV of their making, which then serves other clients' requests."""
    token = kv_token_from_env()
    if token is None and args.role in ("prefill", "decode"):
        if not args.insecure_kv_transfer:
            raise SystemExit(
                f"llm-fleet serve: the {args.role} role needs {KV_TOKEN_ENV}, one random value shared by the "
                "router and every prefill and decode server (e.g. `export "
                f"{KV_TOKEN_ENV}=$(openssl rand -hex 16)`), or --insecure-kv-transfer"
            )
        log.warning(
            "INSECURE: --insecure-kv-transfer: no %s, so anyone who reaches this %s server may use its KV "
            "transfer paths, and KV bodies carry no secret MAC",
            KV_TOKEN_ENV,
            args.role,
        )
    return token


def prefill_source(args) -> EndpointSource | None:
    """Where a decode server finds the prefill servers it may fetch KV from; None: nowhere (it
    computes every prompt itself), which it says."""
    if args.prefill_host:
        host, _, port = args.prefill_host.rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit(f"llm-fleet serve: --prefill-host {args.prefill_host}: expected HOST:PORT")
        return ServiceDNS("prefill", host.strip("[]"), int(port))
    if args.endpoints_file:
        return EndpointsFile(args.endpoints_file)
    if args.prefill_url:
        return StaticEndpoints(args.prefill_url, [])
    log.warning(
        "no prefill servers given (--prefill-url, --prefill-host, --endpoints-file): this decode server takes "
        "no KV transfer and computes every prompt itself"
    )
    return None


def served_name(model: str) -> str:
    """The model id answers carry by default: ``--model`` as given, a Hub model's repository id
    (``org/name``, as vLLM names it) without hf:// or the revision."""
    try:
        hub = hub_reference(model) if not Path(model).expanduser().exists() else None
    except ValueError:
        hub = None
    return hub.repo_id if hub else model


def read_chat_template(value: str) -> str:
    """``--chat-template`` as vLLM reads it: a file's text, or else the template itself where the
    value holds Jinja's characters; checked to parse before the model loads."""
    try:
        text = Path(value).read_text()
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte, or undecodable text
        if not holds_jinja(value):
            why = "no such file, and no Jinja template either" if isinstance(exc, FileNotFoundError) else exc
            raise SystemExit(f"llm-fleet serve: --chat-template {value}: {why}") from exc
        text = value
    problem = template_problem(text) if holds_jinja(text) else None  # a file may be plain
    if problem is not None:
        raise SystemExit(f"llm-fleet serve: --chat-template: {problem}")
    return text


def warn_of_overridden_flags(path: str, flags: dict) -> None:
    """A --config file's keys win over the engine flags (so that live reloads keep them): say so
    once, at start, for each flag given that the file sets too, rather than drop it unseen."""
    flag_of = {field: flag for flag, (field, *_) in [*FLAGS.items(), *SWITCHES.items()]}
    overridden = file_overrides(read_engine_file(path), flags)
    if overridden:
        named = ", ".join(f"{flag_of[field]}={flags[field]} ({field}: {value})" for field, value in overridden.items())
        log.warning("--config %s sets what these flags set, and its keys win: %s", path, named)


def serve(args) -> int:
    configure_logging(args.log_level)
    state, watcher = local_engine_state(args)

    def stop() -> None:
        if watcher is not None:
            watcher.stop()
        state.engine.shutdown()
        close_workers = getattr(state.engine.engine.runner, "close", None)
        if close_workers is not None:  # a parallel model's worker processes
            close_workers()

    return run_app(add_vllm_http_flags(create_app(state), args), state, args, on_exit=stop)
