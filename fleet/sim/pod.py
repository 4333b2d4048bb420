"""A simulated pod: the real engine loop and scheduler (server/engine, server/core) on simulated
time, with a runner that computes nothing and takes as long as the cost model says.

Each pod owns its clock. ``run_step(now)`` sets it to ``now``, lets the engine schedule, and the
``CostModelRunner`` moves it forward by the modeled step time, so the engine stamps the step's
tokens at the step's end, as the real runner's forward pass does in wall time. The fleet holds a
step's outputs until that end time (``pending``) before anyone sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.batch import SchedulerOutput
from llmfleet.server.core.kv_wire import KVImport
from llmfleet.server.core.request import Request, SampledToken, SamplingParams
from llmfleet.server.core.validation import check_context_length
from llmfleet.server.engine.engine import LLMEngine, RequestOutput
from llmfleet.server.runner.step_shapes import warm_up_sizes, warm_up_tokens
from llmfleet.sim.cost_model import CostModel, StepFeatures

TOKEN = SampledToken(token_id=0)  # what every simulated sample "generates"; never a stop token
OWN_TOKENS = 1 << 62  # past any content block id: a request's own tokens are OWN_TOKENS + its number
MIN_STEP_S = 1e-6  # a step always takes some time, so simulated time always moves


class PodConfigError(ValueError):
    """An engine configuration the real server would refuse to start with."""


def pod_max_model_len(config: EngineConfig, cost: CostModel) -> int:
    """A pod's context limit: the engine's ``max_model_len`` when set, else the model's (the
    profile's). Past the model's limit the real runner refuses to start
    (server/runner/torch_runner.py), and so does a simulated pod."""
    if config.max_model_len is None:
        return cost.max_model_len
    if config.max_model_len > cost.max_model_len:
        raise PodConfigError(
            f"maxModelLen {config.max_model_len} exceeds the model's limit {cost.max_model_len} "
            f"(max_model_len of the {cost.model} cost profile)"
        )
    return config.max_model_len


class SimClock:
    """A pod's engine clock: read by the scheduler and the engine, moved by the runner."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class CostModelRunner:
    """``ModelRunner`` with no model: each step takes ``cost.step_seconds`` of simulated time."""

    def __init__(
        self,
        cost: CostModel,
        clock: SimClock,
        *,
        num_kv_blocks: int,
        kv_block_size: int,
        max_model_len: int | None = None,
        warmed: frozenset[int] = frozenset(),
    ) -> None:
        """``max_model_len``: the pod's context limit (default: the profile's);
        ``warmed``: the step sizes its start-up warm-up ran (server/runner/warm_up.py)."""
        self.cost = cost
        self.clock = clock
        self.num_kv_blocks = num_kv_blocks
        self.kv_block_size = kv_block_size
        self.max_model_len = max_model_len or cost.max_model_len
        self.eos_token_ids: frozenset[int] = frozenset()
        self.vocab_size = None  # simulated prompts embed nothing
        self.structured_output = False
        self.last_features: StepFeatures | None = None
        self.seen_sizes = set(warmed)  # step sizes this pod has run (new_shape: first-use kernel compiles)

    def execute(self, output: SchedulerOutput) -> list[SampledToken | None]:
        self.last_features = self.cost.features(output, self.kv_block_size, self.seen_sizes)
        self.clock.now += max(MIN_STEP_S, self.cost.step_seconds(self.last_features))
        return [TOKEN if item.sample else None for item in output.scheduled]

    def release(self, request_id: str) -> None:
        pass


class PodState(StrEnum):
    STARTING = "starting"  # scheduled, pulling, loading the model: costs money, serves nothing
    READY = "ready"  # in the router's endpoints
    DRAINING = "draining"  # out of the endpoints, finishing its in-flight requests
    STOPPED = "stopped"


@dataclass
class StepRecord:
    end: float
    seconds: float
    batch: int
    tokens: int


@dataclass
class SimPod:
    name: str
    pool: str
    engine: LLMEngine
    clock: SimClock
    created_at: float
    ready_at: float
    state: PodState = PodState.STARTING
    stopped_at: float | None = None
    drain_deadline: float | None = None
    busy_until: float | None = None  # the end of the step in flight
    wake_at: float | None = None  # a pending wake-up for a batching window
    pending: list[RequestOutput] = field(default_factory=list)
    preemptions_seen: int = 0
    prefix_hits_seen: int = 0
    unstarted: set[str] = field(default_factory=set)  # sent here, no token seen by the router yet
    incoming: int = 0  # sent here by the router, their KV still on its way (a decode pod)
    caches: bool = False  # prompts carry content: the prefix cache runs as the pool's config says

    @classmethod
    def create(
        cls,
        name: str,
        pool: str,
        config: EngineConfig,
        cost: CostModel,
        *,
        now: float,
        startup_s: float,
        caches: bool = False,
    ) -> SimPod:
        """``caches``: the requests say what their prompts share (``RequestSpec.blocks``), so the
        pod's prefix cache runs if its config enables it; otherwise prompts are lengths alone and
        the pod caches nothing."""
        clock = SimClock(now)
        blocks = config.num_kv_blocks or cost.num_kv_blocks(config.kv_cache_memory_mb, config.kv_block_size)
        max_model_len = pod_max_model_len(config, cost)
        warmed = frozenset()
        if cost.pads_steps:  # as the real runner, warmed up to its first budget (which may grow later)
            tokens = warm_up_tokens(config.max_num_batched_tokens, blocks, config.kv_block_size, max_model_len)
            warmed = frozenset(warm_up_sizes(tokens))
        runner = CostModelRunner(
            cost,
            clock,
            num_kv_blocks=blocks,
            kv_block_size=config.kv_block_size,
            max_model_len=max_model_len,
            warmed=warmed,
        )
        engine = LLMEngine(_caching(config, caches), runner, clock=clock)
        state = PodState.READY if startup_s <= 0 else PodState.STARTING
        ready_at = now + max(0.0, startup_s)
        return cls(name, pool, engine, clock, created_at=now, ready_at=ready_at, state=state, caches=caches)

    # -- requests -------------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_len: int,
        output_len: int,
        arrival: float,
        blocks: tuple[int, ...] = (),
        block_tokens: int = 0,
        number: int = 0,
        cached_blocks: int = 0,
    ) -> Request:
        """Queue a client request of ``prompt_len`` tokens and ``output_len`` out, as a server of
        this pod's pool gets it. Raises the server's errors: too long for the context (checked
        first, as the server's API does, for the whole request), queue full, more KV than the
        cache holds. On a caching pod the prompt is its content ``blocks`` of ``block_tokens``
        tokens, then request ``number``'s own tokens (``simulated_prompt``).

        In disaggregated mode each pod runs its server's share (server/openai/kv_transfer.py): a
        prefill pod computes all but the last prompt token and samples one token, which nobody
        sees; a decode pod imports the KV of those tokens, computes the last one and samples the
        client's tokens, the first of them too. A one-token prompt has nothing to transfer: its
        decode pod computes it. ``cached_blocks``: the leading blocks the decode pod found in its
        prefix cache when it fetched the rest (``cached_prefix_blocks``), as its server's
        ``first_block``."""
        # before the filler prompt is built: a prompt of 1e11 tokens is refused, not allocated
        check_context_length(self.max_model_len, prompt_len, output_len)
        kv_import = None
        if self.pool == "prefill":
            prompt_len, output_len = prompt_len - 1, 1
        elif self.pool == "decode" and prompt_len > 1:
            # the runner writes nothing
            kv_import = KVImport(num_tokens=prompt_len - 1, payload=memoryview(b""), first_block=cached_blocks)
        sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        if self.caches:
            prompt = simulated_prompt(prompt_len, blocks, block_tokens, number)
        else:
            prompt = [1] * prompt_len
        return self.engine.add_request(request_id, prompt, sampling, arrival_time=arrival, kv_import=kv_import)

    def cached_prefix_blocks(self, prompt_len: int, blocks: tuple[int, ...], block_tokens: int, number: int) -> int:
        """The leading full blocks of a prompt's transferred part (all but its last token) in this
        pod's prefix cache now: what its server leaves out of the KV it fetches."""
        if not self.caches or not blocks or prompt_len < 2:
            return 0
        prompt = simulated_prompt(prompt_len, blocks, block_tokens, number)
        return self.engine.block_manager.cached_prefix_blocks(prompt[:-1])

    @property
    def block_size(self) -> int:
        return self.engine.block_manager.block_size

    @property
    def max_model_len(self) -> int:
        return self.engine.runner.max_model_len

    @property
    def in_flight(self) -> int:
        s = self.engine.scheduler
        return s.num_waiting + s.num_running

    @property
    def assigned(self) -> int:
        """The requests the router sent here and has not seen finish: those in the engine, and
        those whose KV is still on its way."""
        return self.in_flight + self.incoming

    @property
    def kv_usage(self) -> float:
        return self.engine.block_manager.usage

    @property
    def alive(self) -> bool:
        return self.state != PodState.STOPPED

    @property
    def idle(self) -> bool:
        return self.busy_until is None and not self.engine.has_unfinished_requests()

    # -- stepping -------------------------------------------------------------------------------

    def run_step(self, now: float) -> StepRecord | None:
        """One engine step starting at ``now``. Returns its record (its outputs wait in
        ``pending`` until ``record.end``), or None when nothing could be scheduled."""
        self.clock.now = now
        outputs = self.engine.step()
        runner: CostModelRunner = self.engine.runner  # type: ignore[assignment]
        if self.clock.now == now:  # nothing ran (a batching window holds, or only aborts)
            self.pending.extend(outputs)
            return None
        self.pending.extend(outputs)
        self.busy_until = self.clock.now
        stats = self.engine.stats()
        features = runner.last_features
        return StepRecord(
            self.clock.now,
            self.clock.now - now,
            stats.last_batch_size,
            features.tokens if features else stats.last_num_tokens,
        )

    def take_outputs(self) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        return outputs

    def new_preemptions(self) -> int:
        total = self.engine.scheduler.num_preemptions
        new, self.preemptions_seen = total - self.preemptions_seen, total
        return new

    def new_prefix_hits(self) -> int:
        """Prompt tokens found in the prefix cache since the last call (vllm:prefix_cache_hits)."""
        total = self.engine.block_manager.prefix_hits
        new, self.prefix_hits_seen = total - self.prefix_hits_seen, total
        return new

    def drain(self, now: float, timeout_s: float) -> None:
        self.state = PodState.DRAINING
        self.drain_deadline = now + timeout_s
        self.engine.flush()  # nothing more will join: no batching window should hold the rest

    def abort_all(self) -> list[str]:
        """The drain deadline passed (the kubelet kills the pod): abort what is left."""
        ids = [r.request_id for r in (*self.engine.scheduler.running, *self.engine.scheduler.waiting)]
        for rid in ids:
            self.engine.abort_request(rid)
        return ids

    def update_config(self, config: EngineConfig) -> None:
        self.engine.update_config(_caching(config, self.caches))


def simulated_prompt(length: int, blocks: tuple[int, ...], block_tokens: int, number: int) -> list[int]:
    """Token ids that stand for a prompt: each content block's id over its ``block_tokens``
    tokens, then request ``number``'s own id for the rest. Prompts opening with the same blocks
    open with the same tokens and share those KV blocks in the prefix cache; nothing else matches."""
    ids = [block for block in blocks for _ in range(block_tokens)][:length]
    return ids + [OWN_TOKENS + number] * (length - len(ids))


def _caching(config: EngineConfig, caches: bool) -> EngineConfig:
    """Where requests give lengths alone, filler prompts would all read as one cached prefix: such
    a pod caches nothing."""
    return config if caches else config.model_copy(update={"enable_prefix_caching": False})
