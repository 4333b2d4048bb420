"""`llm-fleet serve --role router`: wiring of the endpoint source, balancer, holding, proxy and app."""

from __future__ import annotations

import logging
from functools import partial

import httpx

from llmfleet.arguments import configure_logging
from llmfleet.server.http.app import add_vllm_http_flags, build_app
from llmfleet.server.http.drain import run_app
from llmfleet.server.http.state import ServerState
from llmfleet.server.router.balancer import Balancer
from llmfleet.server.router.hold import Holding, HoldSettings
from llmfleet.server.router.proxy import Proxy, ProxySettings
from llmfleet.server.router.router_metrics import RouterMetrics
from llmfleet.server.router.routes import install
from llmfleet.server.router.wake import ConfigMapWaker, NoWaker, Waker
from llmfleet.server.wire.auth import KV_TOKEN_ENV, fleet_headers, kv_token_from_env
from llmfleet.server.wire.endpoints import (
    MODE_POOLS,
    EndpointsFile,
    EndpointSlices,
    EndpointSource,
    StaticEndpoints,
    kube_api,
)
from llmfleet.server.wire.keepalive import pooled

SOURCES_HINT = (
    "the router needs its servers: --colocated-url, or --prefill-url/--decode-url; --endpoints-file; "
    "or --colocated-service, or --prefill-service/--decode-service"
)


def router_mode(args) -> str:
    """``colocated`` when the flags name colocated servers, else ``disaggregated`` (an endpoints
    file says which with ``--router-mode``)."""
    if args.colocated_url or args.colocated_service:
        if args.prefill_url or args.decode_url or args.prefill_service or args.decode_service:
            raise SystemExit("colocated servers and prefill/decode servers do not go together: one mode per router")
        return "colocated"
    if args.endpoints_file:
        return args.router_mode
    return "disaggregated"


def endpoint_source(args) -> EndpointSource:
    if args.endpoints_file:
        return EndpointsFile(args.endpoints_file)
    if args.colocated_service:
        return EndpointSlices.in_cluster({"colocated": args.colocated_service}, api_url=args.kube_api)
    if args.prefill_service or args.decode_service:
        if not (args.prefill_service and args.decode_service):
            raise SystemExit("--prefill-service and --decode-service go together")
        services = {"prefill": args.prefill_service, "decode": args.decode_service}
        return EndpointSlices.in_cluster(services, api_url=args.kube_api)
    if args.colocated_url or args.decode_url:
        return StaticEndpoints(args.prefill_url or [], args.decode_url or [], args.colocated_url or [])
    raise SystemExit(SOURCES_HINT)


def waker(args) -> Waker:
    if not args.wake_config_map:
        return NoWaker()
    api, namespace = kube_api(args.kube_api)
    return ConfigMapWaker(api, namespace, args.wake_config_map)


def serve(args) -> int:
    configure_logging(args.log_level)
    mode = router_mode(args)
    source = endpoint_source(args)
    model_name, *aliases = args.served_model_name or [args.model]
    metrics = RouterMetrics(model_name, MODE_POOLS[mode])
    state = ServerState(
        None, None, model_name, 0, metrics, role="router", api_keys=args.api_key, model_aliases=tuple(aliases)
    )
    state.max_body_bytes = int(args.max_request_body_mb * 2**20)
    # Connections to the servers are reused: a KV-transfer round trip should cost no handshake.
    limits = pooled(max_connections=2048, max_keepalive_connections=256)
    # the servers share the key, and the transfer token only our hops carry
    token = kv_token_from_env()
    if token is None and mode == "disaggregated":
        logging.getLogger("llmfleet.router").warning(
            "no %s: prefill and decode servers started with one refuse this router's transfers", KV_TOKEN_ENV
        )
    client = httpx.AsyncClient(limits=limits, headers=fleet_headers(args.api_key[0] if args.api_key else None, token))
    balancer = Balancer(source, args.router_policy, client, mode)
    settings = ProxySettings(prefill_timeout_s=args.prefill_timeout, decode_timeout_s=args.decode_timeout)
    holding = Holding(balancer, HoldSettings(args.hold_timeout, args.max_held), metrics, waker(args))
    proxy = Proxy(balancer, client, metrics, settings, holding)
    # /ready fails until a server of the serving pool is known, unless requests are held for one:
    # then the router serves (holds) from the start, and a pool scaled to zero still has an endpoint
    state.not_ready = None if holding.settings.enabled else balancer.not_ready
    logging.getLogger("llmfleet.router").info(
        "%s router for %s: servers from %s; %s",
        mode,
        model_name,
        source.description,
        f"holds up to {args.max_held} requests {args.hold_timeout:g} s each for a pool with no server "
        f"(asking {holding.waker.description})"
        if holding.settings.enabled
        else "no holding: 503 while a pool has no server",
    )
    app = build_app(state, partial(install, proxy=proxy, balancer=balancer))
    return run_app(add_vllm_http_flags(app, args), state, args)
