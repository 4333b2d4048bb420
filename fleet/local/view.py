"""The live terminal view of the local fleet (rich): pools, replicas, knobs, p95 latencies
against the SLO, and the tuner's last decision."""

from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from llmfleet.local.fleet import LocalFleet
from llmfleet.operator.resource.tuner_state import effective_engine
from llmfleet.operator.tuner.run import ROUTER


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _against(seconds: float | None, slo_ms: float) -> Text:
    if seconds is None:
        return Text("-", style="dim")
    return Text(f"{seconds * 1000:.0f} / {slo_ms:.0f}", style="green" if seconds * 1000 <= slo_ms else "bold red")


def render(fleet: LocalFleet, url: str) -> Group:
    slo = fleet.spec.slo
    table = Table(title=f"InferenceService {fleet.name} ({fleet.spec.mode}) at {url}", expand=True)
    for column in (
        "pool",
        "ready/replicas",
        "maxBatchSize",
        "batchTimeoutMs",
        "tokenBudget",
        "TTFT p95 ms / SLO",
        "ITL p95 ms / SLO",
        "queue p95 ms",
        "req/s",
        "waiting",
    ):
        table.add_column(column)
    for name, pool in fleet.pools.items():
        engine = effective_engine(fleet.spec, name, fleet.tuner_state)
        m = fleet.view.last_metrics.get(name)
        draining = f" (+{len(pool.draining)} draining)" if pool.draining else ""
        table.add_row(
            name,
            f"{len(pool.ready_urls())}/{pool.replicas}{draining}",
            str(engine.max_batch_size),
            f"{engine.batch_timeout_ms:g}",
            str(engine.max_num_batched_tokens),
            _against(m.ttft.p95 if m else None, slo.ttft_p95_ms),
            _against(m.itl.p95 if m else None, slo.itl_p95_ms),
            _ms(m.queue_time.p95 if m else None),
            "-" if not m or m.request_rate is None else f"{m.request_rate:.2f}",
            "-" if not m or m.waiting is None else f"{m.waiting:.0f}",
        )
    client = fleet.view.last_metrics.get(ROUTER)
    if fleet.router is not None and client is not None:  # the latency its clients see, the whole wait
        table.add_row(
            ROUTER,
            "1/1" if fleet.router.serving else "0/1",
            "-",
            "-",
            "-",
            _against(client.ttft.p95, slo.ttft_p95_ms),
            _against(client.itl.p95, slo.itl_p95_ms),
            "-",
            "-" if client.request_rate is None else f"{client.request_rate:.2f}",
            "-",
        )
    decision = fleet.view.last_decision
    if decision is None:
        last = Text(
            f"tuner: first run in {fleet.spec.autotune.interval_seconds} s"
            if fleet.spec.autotune.enabled
            else "tuner: disabled (spec.autotune.enabled: false)",
            style="dim",
        )
    elif decision.hold:
        last = Text(f"tuner holds: {decision.hold_reason}", style="yellow")
    elif decision.changes:
        last = Text("\n".join(c.reason for c in decision.changes), style="cyan")  # each names its pool and move
    else:
        last = Text("tuner: no change needed (" + "; ".join(decision.reasons[-2:]) + ")", style="dim")
    history = Text("\n".join(fleet.view.history[-8:]) or "-", style="dim")
    parts = [table]
    if fleet.spec.model.builtin:
        parts.append(
            Text(
                f"model builtin:{fleet.spec.model.builtin}: random weights, its text is gibberish "
                "(point spec.model at a real model for words)",
                style="dim",
            )
        )
    parts.append(Text(f"configs and logs: {fleet.run_dir}", style="dim"))
    if fleet.router is not None:  # disaggregated: the client-facing router in front of both pools
        state = "ready" if fleet.router.serving else "starting"
        parts.append(Text(f"router ({fleet.spec.router.policy}): {state} at {url}", style="dim"))
    return Group(
        *parts,
        Panel(last, title="last decision"),
        Panel(history, title="events"),
        Text("Ctrl-C drains the servers and exits", style="dim"),
    )
