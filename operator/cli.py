"""`llm-fleet operator`: run the kopf operator that serves InferenceServices.

kopf, the Kubernetes client and the handlers are imported in run(), so `llm-fleet --help` stays light.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket

from llmfleet.arguments import bind_problem, port_or_off, positive, positive_int

SERVER_IMAGE_ENV = "LLMFLEET_SERVER_IMAGE"  # resource/spec.py reads it (not imported here: pydantic is slow to load)
GPUS_PER_NODE_ENV = "LLMFLEET_GPUS_PER_NODE"  # the same

HELP = "run the Kubernetes operator for InferenceService resources"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="serve InferenceServices in this namespace (repeatable; globs like team-* work)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace (the default)")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument(
        "--standalone", action="store_true", help="no peering: the only operator instance (the default)"
    )
    peering.add_argument(
        "--peering", metavar="NAME", help="coordinate with other replicas through this kopf peering object"
    )
    parser.add_argument(
        "--priority",
        type=int,
        help="peering: the replica with the highest priority serves, the others stand by (default: one "
        "drawn from the host name, so replicas of one Deployment differ; kopf pauses all replicas that tie)",
    )
    parser.add_argument(
        "--peering-lifetime",
        type=positive_int,
        default=60,
        metavar="SECONDS",
        help="peering: how long a replica that stopped sending keep-alives (killed, cut off) keeps the "
        "others paused before one of them takes over (default: 60, kopf's)",
    )
    parser.add_argument(
        "--liveness",
        metavar="URL",
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument(
        "--prometheus-url",
        default=os.environ.get("LLMFLEET_PROMETHEUS_URL"),
        help="Prometheus API for the tuner (default: $LLMFLEET_PROMETHEUS_URL; none: scrape pods directly)",
    )
    parser.add_argument(
        "--server-image",
        default=os.environ.get(SERVER_IMAGE_ENV),
        help=f"the image of server pods whose InferenceService sets no spec.image (default: ${SERVER_IMAGE_ENV}; "
        "the Helm chart sets it to its own image)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=positive_int,
        default=os.environ.get(GPUS_PER_NODE_ENV, "8"),
        metavar="N",
        help="the GPUs of a node, where an InferenceService sets no spec.gpusPerNode: a replica needing more "
        f"spans nodes, as a LeaderWorkerSet (default: ${GPUS_PER_NODE_ENV}, else 8)",
    )
    parser.add_argument(
        "--prometheus-timeout",
        type=positive,
        default=os.environ.get("LLMFLEET_PROMETHEUS_TIMEOUT_SECONDS", "5"),
        metavar="SECONDS",
        help="the most a tuner run waits for one pool's Prometheus queries before it holds, saying "
        "why (default: $LLMFLEET_PROMETHEUS_TIMEOUT_SECONDS, else 5)",
    )
    parser.add_argument(
        "--metrics-port",
        type=port_or_off,
        default=8081,
        help="serve the tuner's decision metrics (llmfleet_tuner_*) on this port; 0: off",
    )
    parser.add_argument(
        "--pod-monitor-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="label on the PodMonitors it creates, the one your Prometheus selects them by "
        "(kube-prometheus-stack: release=<its release name>); repeatable",
    )
    parser.add_argument(
        "--metrics-namespace-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the servers' metrics port takes scrapes only from pods of namespaces with these labels "
        "(their NetworkPolicies; where Prometheus and this operator run); repeatable; none: every namespace",
    )
    parser.add_argument(
        "--pod-security-allow",
        action="append",
        metavar="KEY",
        help="let InferenceServices ask for what this key names, refused by default (repeatable, or "
        "comma-separated; default: $LLMFLEET_POD_SECURITY_ALLOW): " + ", ".join(_pod_security_keys()),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    parser.add_argument("--debug", action="store_true", help="log everything, including API calls")


def _pod_security_keys() -> tuple[str, ...]:
    from llmfleet.operator.resource.pod_security import KEYS

    return KEYS


def pod_security_allow(given: list[str] | None) -> list[str]:
    """The allowed keys from the flags, else from $LLMFLEET_POD_SECURITY_ALLOW; an unknown one stops the operator."""
    from llmfleet.operator.resource.pod_security import unknown_keys

    text = ",".join(given) if given else os.environ.get("LLMFLEET_POD_SECURITY_ALLOW", "")
    keys = sorted({key for key in text.replace(",", " ").split() if key})
    if unknown := unknown_keys(keys):
        known = ", ".join(_pod_security_keys())
        raise SystemExit(f"llm-fleet operator: --pod-security-allow: no such keys {unknown}; known: {known}")
    return keys


def run(args: argparse.Namespace) -> int:
    import kopf

    from llmfleet.operator import handlers  # noqa: F401  (registers the handlers with kopf)

    labels = key_values("--pod-monitor-label", args.pod_monitor_label)
    peers = key_values("--metrics-namespace-label", args.metrics_namespace_label)
    busy = args.metrics_port and bind_problem("0.0.0.0", args.metrics_port)  # where the metrics server listens
    if busy:  # kopf would retry the startup that binds it every minute, for ever
        raise SystemExit(f"llm-fleet operator: cannot serve metrics on --metrics-port {args.metrics_port}: {busy}")
    if problem := credentials_problem():  # the same: a traceback, then a retry every minute
        raise SystemExit(f"llm-fleet operator: no Kubernetes API to talk to: {problem}")
    if args.server_image:  # read where each spec is parsed (resource/spec.py)
        os.environ[SERVER_IMAGE_ENV] = args.server_image
    os.environ[GPUS_PER_NODE_ENV] = str(args.gpus_per_node)  # the same
    kopf.configure(verbose=args.verbose, debug=args.debug)
    namespaces = tuple(args.namespaces or ())
    memo = kopf.Memo(
        pod_security_allow=pod_security_allow(args.pod_security_allow),
        prometheus_url=args.prometheus_url,
        prometheus_timeout=args.prometheus_timeout,
        metrics_port=args.metrics_port,
        pod_monitor_labels=labels,
        metrics_peers=peers,
        peering_lifetime=args.peering_lifetime,
        # names, not patterns (team-*, !kube-system): kopf need not list the cluster's namespaces
        exact_namespaces=bool(namespaces) and not any(set(ns) & set("*?[!") for ns in namespaces),
    )
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=args.priority if args.priority is not None else default_priority(),
        liveness_endpoint=args.liveness,
        memo=memo,
    )
    return 0


def key_values(flag: str, items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` flags as a mapping; a malformed one stops the operator with one line."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} wants KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def credentials_problem() -> str | None:
    """Why the operator cannot log in to the Kubernetes API (no service account, no kubeconfig, or
    one it cannot read), or None. Later logins (a rotated token) are kopf's and the client's."""
    import yaml

    from llmfleet.operator.reconcile.cluster import load_configuration

    try:
        load_configuration()
    except OSError as exc:
        return f"{exc.strerror or exc}: {exc.filename or ''} (KUBECONFIG={os.environ.get('KUBECONFIG', '')})"
    except yaml.YAMLError as exc:
        return f"the kubeconfig is no YAML ({str(exc).splitlines()[0]})"
    except Exception as exc:  # the client's ConfigException, and whatever else a kubeconfig's contents can raise
        return str(exc)
    return None


def default_priority(host: str | None = None) -> int:
    """A peering priority of this replica's own: a hash of its pod (host) name, stable across the
    pod's restarts and, with 31 bits, all but never the same as another replica's."""
    name = host if host is not None else socket.gethostname()
    return 1 + int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % (2**31 - 1)
