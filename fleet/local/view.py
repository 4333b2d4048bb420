"""The live terminal view of the local fleet (rich): pools, replicas, knobs, p95 latencies
against the SLO, the tuner's last decision and the fleet's events.

It fits an 80x24 terminal: short column headers (the SLOs are in the title), the model line names
what clients send, and the decision and events boxes get the lines left, one line per entry,
cut at the width, so the events box never falls off the bottom."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from llmfleet.local.fleet import LocalFleet
from llmfleet.operator.resource.tuner_state import effective_engine
from llmfleet.operator.tuner.run import ROUTER

COLUMNS = ("pool", "ready", "batch", "wait", "budget", "TTFT", "ITL", "queue", "req/s", "waiting")
FIXED_LINES = 12  # the title, the table's header, rule and caption, the info lines, the boxes' borders, the footer


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _against(seconds: float | None, slo_ms: float) -> Text:
    if seconds is None:
        return Text("-", style="dim")
    return Text(f"{seconds * 1000:.0f}", style="green" if seconds * 1000 <= slo_ms else "bold red")


def _lines(lines: list[str], most: int, style: str) -> Text:
    """The last ``most`` lines, each one line cut with an ellipsis at the width."""
    text = Text("\n".join(lines[-most:]) or "-", style=style, no_wrap=True, overflow="ellipsis")
    return text


def _table(fleet: LocalFleet) -> Table:
    slo = fleet.spec.slo
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    for column in COLUMNS:
        table.add_column(column, no_wrap=True)
    for name, pool in fleet.pools.items():
        engine = effective_engine(fleet.spec, name, fleet.tuner_state)
        m = fleet.view.last_metrics.get(name)
        draining = f"+{len(pool.draining)}d" if pool.draining else ""
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
    if fleet.router is not None:  # what its clients see: the whole wait, held requests included
        table.add_row(
            ROUTER,
            "1/1" if fleet.router.serving else "0/1",
            "-",
            "-",
            "-",
            _against(client.ttft.p95 if client else None, slo.ttft_p95_ms),
            _against(client.itl.p95 if client else None, slo.itl_p95_ms),
            "-",
            "-" if not client or client.request_rate is None else f"{client.request_rate:.2f}",
            f"{fleet.view.held} held" if fleet.view.held else "-",
        )
    return table


def _decision(fleet: LocalFleet) -> tuple[list[str], str]:
    decision = fleet.view.last_decision
    if decision is None:
        if fleet.spec.autotune.enabled:
            return [f"tuner: first run in {fleet.spec.autotune.interval_seconds} s"], "dim"
        return ["tuner: disabled (spec.autotune.enabled: false)"], "dim"
    if decision.hold:
        return [f"tuner holds: {decision.hold_reason}"], "yellow"
    if decision.changes and fleet.spec.autotune.mode == "observe":
        return [f"would: {c.reason}" for c in decision.changes], "magenta"
    if decision.changes:
        return [c.reason for c in decision.changes], "cyan"  # each names its pool and move
    return ["tuner: no change needed (" + "; ".join(decision.reasons[-2:]) + ")"], "dim"


def render(fleet: LocalFleet, url: str, height: int = 24) -> Group:
    """The view for a terminal ``height`` lines high (at least 24 shows every part)."""
    spec = fleet.spec
    title = Text(
        f"InferenceService {fleet.name} ({spec.mode}) at {url}", style="bold", no_wrap=True, overflow="ellipsis"
    )
    slo = spec.slo
    legend = Text(
        f"p95 ms (SLO TTFT {slo.ttft_p95_ms:g}, ITL {slo.itl_p95_ms:g}); wait=batchTimeoutMs, "
        "budget=maxNumBatchedTokens",
        style="dim",
        no_wrap=True,
        overflow="ellipsis",
    )
    parts: list = [title, _table(fleet), legend]
    model = f"model: send model={fleet.served_name!r}"
    if spec.model.builtin:
        model += f" (builtin:{spec.model.builtin}: random weights, gibberish text)"
    parts.append(Text(model, style="dim", no_wrap=True, overflow="ellipsis"))
    router = f"router ({spec.router.policy}) {'ready' if fleet.router and fleet.router.serving else 'starting'}"
    cold = fleet.view.last_cold_start_s
    if cold is not None:
        router += f", last cold start {cold:.1f} s"
    router += "; its /metrics on the client port"
    parts.append(Text(router, style="dim", no_wrap=True, overflow="ellipsis"))
    where = f"{fleet.run_dir}: configs, logs, {fleet.targets_file.name} (each server's /metrics)"
    parts.append(Text(where, style="dim", no_wrap=True, overflow="ellipsis"))
    rows = len(fleet.pools) + 1
    room = max(4, height - FIXED_LINES - rows - 1)
    lines, style = _decision(fleet)
    shown = min(len(lines), max(1, room // 3))
    observing = spec.autotune.mode == "observe"
    panel = "last decision (observe mode: would-be, nothing changed)" if observing else "last decision"
    parts.append(Panel(_lines(lines, shown, style), title=panel))
    parts.append(Panel(_lines(fleet.view.history, max(1, room - shown), "dim"), title="events"))
    parts.append(Text("Ctrl-C drains the servers and exits", style="dim"))
    return Group(*parts)
