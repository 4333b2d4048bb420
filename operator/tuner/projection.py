"""How a pool's owned latencies would move if its load were spread over another pod count: the
question a scale-down asks (would fewer pods hold the SLOs?) and one an SLO no knob restores
asks (how many pods bring it back?). Throughput cannot answer it: a chat pool can sit near its
TTFT SLO at a third of its token throughput, because steps lengthen with load.

With step times, steps stretch as a processor-sharing server's response time does (a busy
window's only as far as its requests turn over within it) and the wait for a batch slot follows
Erlang C; without them, an M/M/1 queue on the demand. The derivation
is in docs/tuner.md."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from llmfleet.operator.metrics.source import PoolMetrics, Quantiles

FULL = 0.95  # a batch or budget this full is queueing, not what the step model describes
TAIL = 0.05  # p95
BEYOND_P99 = 50  # observations above a p99 before its tail says more than noise (5000 gaps in the window)
MIN_BEYOND_P99 = 2  # ... or this many, where they alone break the SLO


@dataclass(frozen=True)
class Projection:
    ratio: float  # the owned latency over its SLO (the larger of TTFT's and ITL's)
    how: str  # the model and its numbers, for reasons


def project(
    pool: str,
    m: PoolMetrics,
    ttft_slo_ms: float,
    itl_slo_ms: float,
    rho: float,
    k: float,
    steps: StepCosts | None,
    surge: float = 1.0,
    pods: float | None = None,
    measured_tail: bool = False,
) -> Projection:
    """The owned latency over its SLO with each pod's load x ``k`` (``cur / n`` to spread it over
    ``n`` pods instead of ``cur``) in a window whose requests in flight run ``surge`` times their
    mean; ``rho`` is the demand per pod now over capacity (for the M/M/1 fallback). ``pods``: the
    pods the window's load was spread over (the ready pods by default). ``measured_tail``: ITL's
    tail read through the quantiles measured between p95 and p99 (itl_tail)."""
    owns_itl = pool in ("colocated", "decode")
    ttft = m.judged_ttft.p95 if owns_ttft(pool, ttft_slo_ms) else None
    itl = m.judged_itl if owns_itl and m.judged_itl.known else None
    load = _StepLoad.of(m, steps, pods) if steps is not None else None
    if load is None:
        itl_p95 = None if itl is None else itl.p95
        after = rho * k * surge
        return Projection(_queueing(ttft, itl_p95, trusted_queue_s(m), ttft_slo_ms, itl_slo_ms, rho, after), "M/M/1")
    period = m.judged_window_s  # the busy window's, as busy_surge's
    spread = load.spread(k, surge, period)
    if spread is None:
        return Projection(math.inf, f"{load.saturation(k, surge, period)}: saturated")
    step, wait_now, wait_then, budget_growth = spread
    first = load.for_first_tokens() if pool == "prefill" and ttft is not None else load
    first_step = step
    if first is not load:
        # a first token waits behind the pods' steps, overheads included (for_first_tokens)
        waited = first.spread(k, surge, period)
        if waited is None:
            stepping = first.saturation(k, surge, period).replace("pods busy", "pods stepping", 1)
            return Projection(math.inf, f"{stepping}: saturated")
        first_step, wait_now, wait_then, budget_growth = waited
    measured = trusted_queue_s(m) or ttft
    if wait_now > 0 and measured is not None and measured < wait_now:
        # M/M/c takes a request's life in the batch as exponential; lives less spread wait less.
        # What the queue measures now scales the model's waits down alike.
        wait_then *= measured / wait_now
        wait_now = measured
    ratios = [0.0]
    if ttft is not None:
        # A request's own prompt work takes as long at any load; what stretches is the steps it
        # shares (the one in flight when it comes, and those of a prompt twice the mean). Counted
        # for fewer pods only: a scale-up that falls short adds one once it shows.
        served = max(ttft - wait_now, 0.0)
        own = load.own_prefill_s
        if load.shared_steps_s is not None:
            own = max(own, served - load.shared_steps_s)
        own = min(own, served) if k * surge > 1.0 else 0.0
        ratios.append(((served - own) * first_step * budget_growth + own + wait_then) * 1000.0 / ttft_slo_ms)
    if itl is not None:
        tail = itl_tail(itl, k * surge * step, itl_slo_ms / 1000.0, measured_tail)
        ratios.append(tail * step * 1000.0 / itl_slo_ms)
    how = f"pods busy {load.work:.0%} -> {load.work * k:.0%} of the time"
    how += f" ({load.work * k * surge:.0%} in a busy window)" if surge > 1.0 else ""
    how += f", steps x{step:.2f}"
    if first is not load:
        how += f"; stepping {first.work:.0%} -> {first.work * k:.0%} of the time, first tokens wait x{first_step:.2f}"
    how += f", slot wait p95 {wait_then * 1000:.0f} ms" if wait_then > 0 else ""
    return Projection(max(ratios), how)


def owns_ttft(pool: str, ttft_slo_ms: float) -> bool:
    """Whether a pool's TTFT is its to hold: colocated and prefill always; a decode pool the part
    its slots make clients wait, where the law gives it a finite share
    (Disaggregated.ttft_budgets)."""
    return pool in ("colocated", "prefill") or math.isfinite(ttft_slo_ms)


def first_token_floor(m: PoolMetrics, steps: StepCosts | None) -> tuple[float, float] | None:
    """(the p95 prompt's computed tokens, the seconds its prefill takes alone at ``steps``' knobs):
    a floor under TTFT p95 that no pod count lowers, since every request's first token waits for
    its own prompt and a longer prompt's takes longer. None without prompt lengths or step
    costs. Computed tokens: a prefix-cache hit covers its share of every prompt (both rates
    counted as requests are admitted)."""
    tokens = p95_prompt_computed(m)
    if steps is None or tokens is None:
        return None
    return tokens, steps.prefill_alone_s(tokens)


def p95_prompt_computed(m: PoolMetrics) -> float | None:
    """The p95 prompt's tokens less its prefix-cache hits' share (both rates counted as requests
    are admitted), or None without prompt lengths."""
    if not m.prompt_length.known:
        return None
    tokens = m.prompt_length.p95
    uncached, total = m.uncached_prompt_tokens_per_s(), m.prompt_tokens_per_s
    if uncached is not None and total:
        tokens *= min(1.0, uncached / total)
    return tokens


# a lone decode step is read off step costs whose windows reach down to this many sequences per
# step: a cold start's first fits, over fuller steps, put its overhead anywhere from 3 to 146 ms
LONE_STEP_SEQS = 2.0


def decode_step_floor(steps: StepCosts | None) -> float | None:
    """Seconds a decode step of one sequence takes at ``steps``' costs: a floor under ITL p95
    that no pod count lowers, since a pod with one request still runs such a step per token.
    None without step costs, or where their windows never ran steps that small."""
    if steps is None or steps.fewest_seqs > LONE_STEP_SEQS:
        return None
    return steps.overhead_s + steps.per_seq_s


def itl_tail(itl: Quantiles, growth: float, slo_s: float | None = None, measured: bool = False) -> float:
    """ITL's p95 once the gaps in its tail are ``growth`` times as common, at today's step times.

    The slow gaps are the steps that carry prompt work beside the decodes; the share of steps that
    do grows with the prompts that arrive per step (arrivals per pod x step time). So tomorrow's
    p95 is today's quantile at a tail of ``5% / growth``, read off the measured p95 and p99
    (linear in the tail's mass, as histogram_quantile is within a bucket; past p99 the same
    slope). Scaling the p95 alone missed the jump where that share crosses 5%: 4 -> 3 chat pods
    (growth 1.5) took ITL p95 from 0.143 to 0.198 s, their p96.7 times the step ratio, where p95 x
    the step ratio said 0.16. ``measured``: through the quantiles measured between p95 and p99
    instead (Quantiles.between), for the load the window measured (today's pods in a busy window).
    The line overstates where the slow gaps are few and very slow: 1-2% of the gaps at seconds
    (long prompts in a big budget) put p99 there while p98 is a decode step's. For other counts
    and loads the line stands: read through the measured quantiles, projections to one pod fewer
    missed more of the breaks that count then saw (docs/tuner.md).
    A p99 that a handful of gaps decide (a quiet pool's) is noise: then the p95 stands, as before,
    unless those gaps alone break the SLO (``slo_s``): long prompts in a few hundred gaps a minute
    (at 3 pods p95 0.14 s, p99 3.3 s; at 2 pods the p95 is the prompt steps')."""
    tail = TAIL / growth if growth > 0 else 1.0
    beyond = (itl.samples or 0) * 0.01
    breaking = slo_s is not None and itl.p99 is not None and itl.p99 >= slo_s and beyond >= MIN_BEYOND_P99
    if tail >= TAIL or itl.p99 is None or not (beyond >= BEYOND_P99 or breaking):
        return itl.p95
    q = 1.0 - tail
    if q >= 0.99:
        return itl.p95 + (itl.p99 - itl.p95) * (q - 0.95) / (0.99 - 0.95)
    ladder = [(0.95, itl.p95), *(itl.between if measured else ()), (0.99, itl.p99)]
    (lo, low), (hi, high) = next(pair for pair in itertools.pairwise(ladder) if q <= pair[1][0])
    return low + (high - low) * (q - lo) / (hi - lo)


def slots_for(m: PoolMetrics, steps: StepCosts, k: float) -> int | None:
    """The fewest batch slots at which a pod carrying its load x ``k`` rarely makes a request
    wait for one (Erlang C <= 5%); None when the step model cannot say (saturated, no data)."""
    load = _StepLoad.of(m, replace(steps, slots=None))
    ratio = None if load is None else load.step_ratio(k)
    if ratio is None:
        return None
    busy = load.running * k * ratio
    slots = max(1, math.ceil(busy))
    while erlang_c(slots, busy) > TAIL:
        slots += 1
    return slots


def surge(request_rate: float | None, period_s: float, sd: float, in_flight: float = 0.0) -> float:
    """The load factor of a busy period: Poisson arrivals over ``period_s`` run ``sd`` standard
    deviations above their mean about one period in six (sd 1), far more so at low rates. The
    work a period carries is that of the requests in flight in it, which arrived over the period
    and over one request's life before it (``in_flight`` of them, by Little's law): where
    requests live long against the period, that is many more than the period's arrivals, and
    their total swings less."""
    expected = (request_rate or 0.0) * period_s + in_flight
    return 1.0 + sd / math.sqrt(expected) if expected >= 1.0 else 1.0 + sd


@dataclass(frozen=True)
class StepCosts:
    """The step plane's costs at the knobs the pool will run (the tuner's fit, with the measured
    scale folded in), and those knobs."""

    per_seq_s: float
    per_prompt_token_s: float
    slots: int | None  # maxBatchSize, where the pool has it
    budget: float | None  # maxNumBatchedTokens, where the pool has it
    overhead_s: float = 0.0  # a step's own cost, whatever it carries
    fewest_seqs: float = 1.0  # the fewest sequences per step the fit's windows saw

    def prefill_alone_s(self, tokens: float) -> float:
        """A prompt of ``tokens`` prefilled on an idle pod: its chunks (one per ``budget`` tokens),
        each a step of its own, overhead included."""
        chunks = math.ceil(tokens / self.budget) if self.budget else 1
        return chunks * (self.overhead_s + self.per_seq_s) + self.per_prompt_token_s * tokens


@dataclass(frozen=True)
class _StepLoad:
    """What one pod carries now, per the pods' metrics and the step costs."""

    work: float  # the share of a pod's time its sequences' and prompt tokens' work takes
    running: float  # requests in the batch, on average over time (busy batch slots)
    prompt_tokens: float  # mean prompt tokens per step
    requests_per_s: float  # per pod
    slots: int | None
    budget: float | None
    own_prefill_s: float = 0.0  # a mean prompt's own compute: the part of a TTFT that load does not stretch
    shared_steps_s: float | None = None  # the steps a slow first token shares with others, at today's step time
    stepping: float = 1.0  # the share of a pod's time it runs steps, overheads included (1: back to back)

    @classmethod
    def of(cls, m: PoolMetrics, costs: StepCosts, pods: float | None = None) -> _StepLoad | None:
        pods = m.ready_pods if pods is None else pods
        values = (
            m.running,
            m.mean_batch_size,
            m.mean_step_tokens,
            m.generation_tokens_per_s,
            m.computed_prompt_tokens_per_s(),
        )
        if not pods or not m.request_rate or any(v is None for v in values):
            return None
        running, seqs, tokens, generated, prompted = values
        work = (costs.per_seq_s * generated + costs.per_prompt_token_s * prompted) / pods
        # What fills the budget is the prompt tokens that come in while a step runs: a step's mean
        # where pods step back to back, a fraction of it where they idle between prompts (a
        # prefill pod's lone prompt fills its step whatever the load; more load fills the gaps)
        stepping = _busy_share(m, pods)
        per_step = max(tokens - seqs, 0.0) * stepping
        mean_prompt = m.computed_prompt_tokens_per_request() or 0.0
        own = costs.per_prompt_token_s * mean_prompt
        shared = None
        if m.mean_step_seconds is not None:
            steps = 1 + math.ceil(2.0 * mean_prompt / costs.budget) if costs.budget else 2
            shared = steps * m.mean_step_seconds
        load = cls(
            work, running / pods, per_step, m.request_rate / pods, costs.slots, costs.budget, own, shared, stepping
        )
        if work >= FULL or load._slot_share(1.0) >= FULL or load._budget_share(1.0) >= FULL:
            return None  # saturated now: queueing dominates, which M/M/1 on the demand describes better
        return load

    def for_first_tokens(self) -> _StepLoad:
        """The load a first token waits behind. Where pods step back to back, a step's overhead
        is shared by the sequences in it and only their work stretches the steps (``work``). Where
        they idle between steps (a prefill pod between prompts), a prompt that comes to an idle
        pod runs a step of its own, overhead and all, and one that comes to a busy pod waits for
        the step in flight: what it waits behind is the share of the time the pods step, and
        more arrivals start more such steps until they run back to back. The token work alone
        leaves out the overhead of every such step, and so projected a prefill pool at fewer
        pods within a TTFT that those pods then broke. Unchanged where the pods step back to
        back, and for pods whose steps run for sequences that decode (colocated, decode): a
        prompt joins those steps and shares their overhead, which the step model counts."""
        if self.stepping >= FULL or self.stepping <= self.work:
            return self
        return replace(self, work=self.stepping)

    def step_ratio(self, k: float) -> float | None:
        """How much longer steps take with each pod's arrivals x ``k``; None when the pods' time
        would fill."""
        if self.work * k >= FULL:
            return None
        return (1.0 - self.work) / (1.0 - self.work * k)

    def spread(self, k: float, surge: float = 1.0, period_s: float = 0.0) -> tuple[float, float, float, float] | None:
        """With each pod's arrivals x ``k``, ``surge`` times that over a busy window of
        ``period_s``: (step time ratio, p95 slot wait now, then, growth of the wait for budget), or
        None when that load would saturate the pod."""
        busy = self._busy(k, surge, period_s)
        if busy is None:
            return None
        ratio, occupied, per_step = busy
        if self._slot_share(occupied) >= FULL or self._budget_share(per_step) >= FULL:
            return None
        growth = (1.0 - self._budget_share(1.0)) / (1.0 - self._budget_share(per_step))
        return ratio, self._slot_wait(1.0, 1.0), self._slot_wait(occupied / ratio, ratio), growth

    def _busy(self, k: float, surge: float, period_s: float) -> tuple[float, float, float] | None:
        """(step time ratio, busy slots and prompt tokens per step as multiples of today's) over a
        busy window, or None where its arrivals' work would fill the pods' time.

        Steps stretch with the requests in flight, and those climb to a busier load's level only as
        fast as they turn over (the fluid queue's relaxation time: a request's life at the mean
        load's step time over the pods' idle share): a window of ``period_s`` gets
        ``1 - exp(-period / relaxation)`` of the way from the mean load's steps to the busy load's
        steady state. A prefill pod's requests, a few steps long, get there within a window, and
        its steps stretch as at a steady busy load; a decode's, hundreds of steps long, do not.
        Prompt tokens per step follow the arrivals at once."""
        mean, full = self.step_ratio(k), self.step_ratio(k * surge)
        if mean is None or full is None:
            return None
        reached = 1.0
        if period_s > 0 and self.requests_per_s > 0 and self.running > 0:
            life = self.running / self.requests_per_s * mean  # Little's law, at the mean load's steps
            reached = 1.0 - math.exp(-period_s * (1.0 - self.work * k) / life)
        ratio = mean + (full - mean) * reached
        occupied = k * (mean + (surge * full - mean) * reached)
        return ratio, occupied, k * surge * ratio

    def saturation(self, k: float, surge: float = 1.0, period_s: float = 0.0) -> str:
        """What would run full at arrivals x ``k``, ``surge`` times that over a busy window: the
        pods' time, the batch slots or the budget."""
        busy = self._busy(k, surge, period_s)
        if busy is None:
            return f"pods busy {self.work * k * surge:.0%} of the time"
        _, occupied, per_step = busy
        if self._slot_share(occupied) >= FULL:
            return f"{self.running * occupied:.1f} of {self.slots} batch slots busy"
        return f"{self.prompt_tokens * per_step:.0f} of {self.budget:g} budget tokens per step"

    def _slot_share(self, scale: float) -> float:
        return 0.0 if not self.slots else self.running * scale / self.slots

    def _budget_share(self, scale: float) -> float:
        return 0.0 if not self.budget else self.prompt_tokens * scale / self.budget

    def _slot_wait(self, k: float, ratio: float) -> float:
        """p95 wait for a batch slot (M/M/c, Erlang C) at arrivals x ``k`` and steps x ``ratio``."""
        if not self.slots:
            return 0.0
        busy = self.running * k * ratio
        life = self.running * ratio / self.requests_per_s  # Little: busy slots / arrivals, at the new step
        waits = erlang_c(self.slots, busy)
        if waits <= TAIL:
            return 0.0
        return life / (self.slots - busy) * math.log(waits / TAIL)


def _busy_share(m: PoolMetrics, pods: float) -> float:
    """The share of a pod's time it runs steps (1 where the metrics cannot say)."""
    if m.steps_per_s is None or m.mean_step_seconds is None:
        return 1.0
    return min(1.0, m.steps_per_s / pods * m.mean_step_seconds)


def erlang_c(servers: int, offered: float) -> float:
    """The probability that an arrival waits in an M/M/c queue with ``offered`` Erlangs of load."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    blocked = 1.0  # Erlang B, by its recurrence over the servers
    for k in range(1, servers + 1):
        blocked = offered * blocked / (k + offered * blocked)
    return servers * blocked / (servers - offered * (1.0 - blocked))


def _queueing(
    ttft: float | None,
    itl: float | None,
    queue: float | None,
    ttft_slo_ms: float,
    itl_slo_ms: float,
    rho: float,
    after: float,
) -> float:
    if rho >= 1.0 or after >= 1.0:
        return math.inf
    ratios = [0.0]
    if ttft is not None:
        wait = ttft if queue is None else min(queue, ttft)
        grows = (after / (1.0 - after)) / (rho / (1.0 - rho)) if rho > 0 else 1.0
        ratios.append((ttft - wait + wait * grows) * 1000.0 / ttft_slo_ms)
    if itl is not None:
        ratios.append(itl * (1.0 - rho) / (1.0 - after) * 1000.0 / itl_slo_ms)
    return max(ratios)


def trusted_queue_s(m: PoolMetrics) -> float | None:
    """Queue time p95, or None when it cannot be right: every request's queue time is part of its
    TTFT, so a queue p95 above the TTFT p95 only comes from interpolating inside coarse histogram
    buckets (vLLM's queue-time buckets start at 300 ms) and says nothing about the share."""
    queue, ttft = m.queue_time.p95, m.ttft.p95
    if queue is None or ttft is None or queue > ttft:
        return None
    return queue
