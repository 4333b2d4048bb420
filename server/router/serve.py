"""`llm-fleet serve --role router`: wiring of the endpoint source, balancer, proxy and app."""

from __future__ import annotations

import logging
from functools import partial

import httpx

from llmfleet.server.http.app import build_app
from llmfleet.server.http.drain import run_app
from llmfleet.server.http.state import ServerState
from llmfleet.server.router.balancer import Balancer
from llmfleet.server.router.proxy import Proxy, ProxySettings
from llmfleet.server.router.router_metrics import RouterMetrics
from llmfleet.server.router.routes import install
from llmfleet.server.wire.auth import KV_TOKEN_ENV, fleet_headers, kv_token_from_env
from llmfleet.server.wire.endpoints import EndpointsFile, EndpointSlices, EndpointSource, StaticEndpoints
from llmfleet.server.wire.keepalive import pooled


def endpoint_source(args) -> EndpointSource:
    if args.endpoints_file:
        return EndpointsFile(args.endpoints_file)
    if args.prefill_service or args.decode_service:
        if not (args.prefill_service and args.decode_service):
            raise SystemExit("--prefill-service and --decode-service go together")
        services = {"prefill": args.prefill_service, "decode": args.decode_service}
        return EndpointSlices.in_cluster(services, api_url=args.kube_api)
    if args.decode_url:
        return StaticEndpoints(args.prefill_url or [], args.decode_url)
    raise SystemExit(
        "the router needs its servers: --prefill-url/--decode-url, --endpoints-file, "
        "or --prefill-service/--decode-service"
    )


def serve(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    source = endpoint_source(args)
    model_name, *aliases = args.served_model_name or [args.model]
    metrics = RouterMetrics(model_name)
    state = ServerState(
        None, None, model_name, 0, metrics, role="router", api_key=args.api_key, model_aliases=tuple(aliases)
    )
    state.max_body_bytes = int(args.max_request_body_mb * 2**20)
    # Connections to the servers are reused: a KV-transfer round trip should cost no handshake.
    limits = pooled(max_connections=2048, max_keepalive_connections=256)
    # the servers share the key, and the transfer token only our hops carry
    token = kv_token_from_env()
    if token is None:
        logging.getLogger("llmfleet.router").warning(
            "no %s: prefill and decode servers started with one refuse this router's transfers", KV_TOKEN_ENV
        )
    client = httpx.AsyncClient(limits=limits, headers=fleet_headers(args.api_key, token))
    balancer = Balancer(source, args.router_policy, client)
    settings = ProxySettings(prefill_timeout_s=args.prefill_timeout, decode_timeout_s=args.decode_timeout)
    proxy = Proxy(balancer, client, metrics, settings)
    state.not_ready = balancer.not_ready  # /ready fails until a decode server is known
    logging.getLogger("llmfleet.router").info("router for %s: servers from %s", model_name, source.description)
    return run_app(build_app(state, partial(install, proxy=proxy, balancer=balancer)), state, args)
