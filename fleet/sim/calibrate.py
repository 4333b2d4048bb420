"""`llm-fleet calibrate`: fit the simulator's step-time model to the real engine on this machine.

It builds the real ``LLMEngine`` with the torch runner (dtype ``auto`` by default, as the engine
serves), drives it through a grid of step shapes (decode batches over several context lengths
with spread prompts, so the decode groups are as in real traffic; decodes with a prompt chunk
mixed in; prompt chunks alone, at an offset, and several prompts in one step), times every
``engine.step()`` (scheduler, forward, sampling, detokenizing: everything a simulated step stands
for), keeps the median of each shape's repeats and, apart, each shape's first step (the kernels
compiled for a new step size: ``new_shape``), then replays a short serving trace (every step a
sample: the shapes serving visits, timed while serving), fits ``cost_model.fit`` and writes a JSON profile,
by default ``$LLMFLEET_CACHE/calibration/<model>.json``. The torch thread count is pinned
(``--threads``) and recorded; `llm-fleet bench sim-fidelity` runs the real engine with the same
count. About 4 minutes for builtin:small on a 2-core CPU; ``--quick`` (builtin:tiny, a smaller grid)
a few seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from llmfleet.arguments import positive_int
from llmfleet.server.engine_flags import dtype
from llmfleet.sim.cost_model import (
    CPU_GROUP_COST_BLOCKS,
    FEATURES,
    CostModel,
    Sample,
    StepFeatures,
    default_profile_path,
    fit,
)
from llmfleet.sim.paths import file_problem

REPLAY_SEED = 7
HELP = "fit the simulator's step-time model to real engine measurements on this machine (torch)"


@dataclass(frozen=True)
class Grid:
    contexts: tuple[int, ...]  # decode context lengths (prompts spread 0.5x..1.5x around each)
    batches: tuple[int, ...]  # decode batch sizes
    chunks: tuple[int, ...]  # prompt chunk sizes
    mixed_batches: tuple[int, ...]  # decode batch sizes that also get a prompt chunk
    offsets: tuple[int, ...]  # earlier context of a prompt chunk (0: the prompt's first chunk)
    multi: tuple[int, ...]  # several fresh prompts in one step (how many), their total a chunk size
    max_decode_tokens: int  # cap on batch x context per decode point (KV memory and set-up time)
    reps: int  # repeats of every shape; the median is kept
    replay: int  # requests of the serving replay (anyscale-online lengths), every step a sample


GRIDS = {
    "full": Grid(
        contexts=(64, 256, 768),
        batches=(1, 4, 8, 16, 32, 64),
        chunks=(16, 64, 192, 512, 1024),
        mixed_batches=(1, 8, 16, 32),
        offsets=(0, 512),
        multi=(4, 8),
        max_decode_tokens=8192,
        reps=5,
        replay=32,
    ),
    "quick": Grid(
        contexts=(64, 512),
        batches=(1, 4, 16, 32),
        chunks=(32, 128, 512),
        mixed_batches=(4, 16),
        offsets=(0, 256),
        multi=(4,),
        max_decode_tokens=4096,
        reps=3,
        replay=4,
    ),
}


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="model to measure (default builtin:small; builtin:tiny with --quick)")
    parser.add_argument("--quick", action="store_true", help="builtin:tiny (unless --model) and a small grid: seconds")
    parser.add_argument(
        "--threads", type=positive_int, help="torch threads (default: torch's default); recorded in the profile"
    )
    parser.add_argument(
        "--dtype", type=dtype, default="auto", help="auto (the engine's default: bfloat16 where native), float32"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", help="profile path (default $LLMFLEET_CACHE/calibration/<model>.json)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="write the profile even when its fit is poor")


def run(args) -> int:
    model = args.model or ("builtin:tiny" if args.quick else "builtin:small")
    grid = GRIDS["quick" if args.quick else "full"]
    out = args.out or default_profile_path(model)
    problem = file_problem(out)  # now, not after minutes of measuring
    if problem:
        print(f"llm-fleet calibrate: cannot write the profile: {problem}")
        return 2
    print(f"== calibrating {model} on {args.device} ({'quick' if args.quick else 'full'} grid): timing engine steps")
    from llmfleet.server.engine.build import LOAD_ERRORS

    try:
        profile = calibrate(model, grid, threads=args.threads, dtype=args.dtype, device=args.device, seed=args.seed)
    except LOAD_ERRORS as exc:
        raise SystemExit(f"llm-fleet calibrate: cannot measure {model}: {exc}") from exc
    print_report(profile)
    advice = fit_advice(profile, quick=args.quick)
    if advice and not args.force:
        print(advice + f"\nnot written: {out} (--force writes it anyway)")
        return 1
    path = profile.save(out)
    print((advice + "\n" if advice else "") + f"wrote {path}")
    return 0


def fit_advice(profile: CostModel, quick: bool = False) -> str:
    """A warning and what to do when the fit would make the simulator wrong; '' for a good fit."""
    problems = profile.quality.problems() if profile.quality is not None else []
    if not problems:
        return ""
    longer = "a longer run (without --quick)" if quick else "another run"
    return (
        "WARNING: a poor fit, the simulator would be wrong with it: "
        + "; ".join(problems)
        + f". Try {longer} on a quieter machine (stop other busy processes; steps slowed by them are what a "
        "fit cannot explain), with --threads pinned to the cores the engine gets."
    )


def calibrate(
    model: str, grid: Grid, *, threads: int | None = None, dtype: str = "auto", device: str = "cpu", seed: int = 0
) -> CostModel:
    """Measure ``model`` over ``grid`` and return the fitted profile (not yet saved)."""
    import platform
    from datetime import UTC, datetime

    import torch

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    bench = _Bench(model, grid, dtype, device, seed)
    samples = bench.measure() + bench.replay(grid.replay)
    coefficients, quality = fit(samples, FEATURES)
    return CostModel(
        coefficients=coefficients,
        model=model,
        device=str(bench.engine.runner.device),
        dtype=bench.dtype,
        threads=torch.get_num_threads(),
        kv_bytes_per_token=bench.kv_bytes_per_token,
        max_model_len=bench.engine.runner.max_model_len,
        kv_block_size=bench.engine.runner.kv_block_size,
        quality=quality,
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") + f" ({time.perf_counter() - started:.0f} s)",
        host=f"{platform.node()} {platform.processor() or platform.machine()}",
        samples=[s.to_dict() for s in samples],
    )


class _Bench:
    """The real engine with a recording hook on its runner: every timed step becomes a measurement."""

    def __init__(self, model: str, grid: Grid, dtype: str, device: str, seed: int) -> None:
        import random

        from llmfleet.server.config import EngineConfig
        from llmfleet.server.engine.build import build_engine

        self.grid = grid
        self.rng = random.Random(seed)
        longest = max(max(grid.contexts) * 3 // 2, max(grid.offsets) + max(grid.chunks))
        need_tokens = max(grid.max_decode_tokens * 3 // 2, longest) + 4096
        config = EngineConfig(
            dtype=dtype,
            max_batch_size=max(grid.batches) + 1,
            max_num_batched_tokens=4096,
            num_kv_blocks=need_tokens // 16 + 1,
            kv_block_size=16,
            max_queue_len=4096,
        )
        # started as a server starts, warmed up to the default budget (server/runner/warm_up.py):
        # the grid's larger steps are its first runs of a size (new_shape), as after the tuner
        # grows a server's budget
        serving_start = config.model_copy(update={"max_num_batched_tokens": EngineConfig().max_num_batched_tokens})
        self.engine, _ = build_engine(model, serving_start, device=device)
        runner = self.engine.runner
        self.dtype = str(runner.dtype).removeprefix("torch.")
        self.kv_bytes_per_token = runner.kv_bytes_per_block // runner.kv_block_size
        self.vocab = runner.model.config.vocab_size
        self.config = config
        group_cost = None if runner.device.type == "cuda" else CPU_GROUP_COST_BLOCKS
        self._features: StepFeatures | None = None
        self._seen = set(runner.warm_sizes)  # step sizes run so far, for new_shape
        execute = runner.execute

        def recording_execute(output):
            self._features = StepFeatures.of(output, runner.kv_block_size, group_cost, self._seen, runner.pad_steps)
            return execute(output)

        runner.execute = recording_execute
        self._ids = 0
        self._live: list[str] = []

    # -- driving the engine ---------------------------------------------------------------------

    def _add(self, prompt_len: int, max_tokens: int) -> str:
        from llmfleet.server.core.request import SamplingParams

        self._ids += 1
        rid = f"cal-{self._ids}"
        prompt = [self.rng.randrange(10, self.vocab) for _ in range(prompt_len)]
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        self._live.append(rid)
        return rid

    def _budget(self, tokens: int) -> None:
        self.engine.update_config(self.config.model_copy(update={"max_num_batched_tokens": tokens}))

    def _step(self) -> tuple[StepFeatures | None, float]:
        self._features = None
        self.engine.flush()
        started = time.perf_counter()
        self.engine.step()
        return self._features, time.perf_counter() - started

    def _point(self, kind: str, out: list[Sample], before=None) -> None:
        """``reps`` steps of one shape (``before`` sets each up, untimed); keeps the median, and
        a first step of a size never run before on its own (``new_shape``)."""
        timed = []
        for _ in range(self.grid.reps):
            if before is not None:
                before()
            features, seconds = self._step()
            if features is None:
                continue
            if features.new_shape:
                out.append(Sample(features, seconds, "new-shape"))
            else:
                timed.append((seconds, features))
        if timed:
            timed.sort(key=lambda t: t[0])
            seconds, features = timed[len(timed) // 2]
            out.append(Sample(features, seconds, kind))

    def _clear(self) -> None:
        for rid in self._live:
            self.engine.abort_request(rid)  # False for those already finished
        self._live.clear()
        self.engine.step()

    def _running_ids(self) -> list[str]:
        return [r.request_id for r in self.engine.scheduler.running]

    # -- the grid -------------------------------------------------------------------------------

    def measure(self) -> list[Sample]:
        g = self.grid
        samples: list[Sample] = []
        self._add(64, 8)
        for _ in range(8):
            self._step()  # first calls allocate and pick kernels: not measured
        self._clear()
        decode_steps = g.reps * (len(g.batches) + 2) + g.reps * len(g.chunks) * len(g.mixed_batches) + 8
        for ctx in g.contexts:
            batch = max((b for b in g.batches if b * ctx <= g.max_decode_tokens), default=1)
            self._budget(4096)
            # prompts spread 0.5x..1.5x ctx in random order (any first b of them spread too): decode
            # groups as in real traffic
            spreads = [0.5 + (i / (batch - 1) if batch > 1 else 0.5) for i in range(batch)]
            self.rng.shuffle(spreads)
            for spread in spreads:
                self._add(max(1, round(ctx * spread)), decode_steps)
            while any(r.is_prefilling for r in self.engine.scheduler.running) or self.engine.scheduler.waiting:
                self._step()
            for b in sorted((b for b in g.batches if b <= batch), reverse=True):
                for rid in self._running_ids()[b:]:
                    self.engine.abort_request(rid)
                self._budget(4096)
                self.engine.step()  # the aborts
                self._point("decode", samples)
                if b in g.mixed_batches:
                    for chunk in g.chunks:
                        self._budget(b + chunk)
                        # its chunk is the whole prompt: it ends in the step it is measured in
                        self._point("mixed", samples, before=lambda chunk=chunk: self._add(chunk, 1))
            self._clear()
        for offset in g.offsets:
            for chunk in g.chunks:

                def setup(offset=offset, chunk=chunk) -> None:
                    self._clear()
                    self._add(offset + chunk, 1)
                    if offset:
                        self._budget(offset)
                        self._step()  # the earlier context, unmeasured
                    self._budget(chunk)

                self._point("prefill", samples, before=setup)
        for count in g.multi:
            for chunk in g.chunks:
                if chunk < 2 * count:
                    continue

                def setup_many(count=count, chunk=chunk) -> None:
                    self._clear()
                    for _ in range(count):
                        self._add(chunk // count, 1)
                    self._budget(chunk)

                self._point("prefill", samples, before=setup_many)
        self._clear()
        return samples

    def replay(self, requests: int) -> list[Sample]:
        """A serving replay: ``requests`` of anyscale-online's lengths arriving at 1 request/s
        of the engine's own time (the sum of its steps), through a serving config (batch 16,
        budget 512, chunked prefill), every step a sample. Steps in isolation, as the grid runs
        them, can run faster than the same shapes while serving (clocks under sustained load,
        caches that the next step's shape evicts): on a 2-core CPU the grid alone left the
        simulator 13-16% short of a real run's busy time. The replay's steps weigh in the fit
        for the shapes serving visits; its trace is not the one sim-fidelity replays."""
        from llmfleet.server.core.request import SamplingParams
        from llmfleet.workloads import anyscale_online, prompt_tokens

        self._clear()
        self.engine.update_config(self.config.model_copy(update={"max_batch_size": 16, "max_num_batched_tokens": 512}))
        trace = replace(anyscale_online(1.0, requests), seed=REPLAY_SEED)
        pending = list(enumerate(trace.requests()))
        samples: list[Sample] = []
        clock = 0.0
        while pending or self.engine.has_unfinished_requests():
            if pending and not self.engine.has_unfinished_requests():
                clock = max(clock, pending[0][1].arrival_s)
            while pending and pending[0][1].arrival_s <= clock:
                i, spec = pending.pop(0)
                sampling = SamplingParams(max_tokens=spec.output_len, temperature=0, ignore_eos=True)
                self.engine.add_request(f"replay-{i}", prompt_tokens(spec, i, self.vocab, REPLAY_SEED), sampling)
            features, seconds = self._step()
            clock += seconds
            if features is not None:
                samples.append(Sample(features, seconds, "serving"))
        self.engine.update_config(self.config)
        return samples


# --- report ------------------------------------------------------------------------------------


def print_report(profile: CostModel) -> None:
    q = profile.quality
    print(f"== cost profile of {profile.model} ({profile.dtype}, {profile.device}, {profile.threads} threads)")
    print(f"   step time = {profile.describe()}")
    if q is None:
        return
    print(
        f"   fit over {q.samples} samples (grid shapes: median of repeats; replay: every step; {q.trimmed} outliers "
        f"left out): R^2 {q.r2:.3f}, mean |error| {q.mean_abs_rel_error:.1%}, p90 |error| {q.p90_abs_rel_error:.1%}"
    )
    print("   mean |error| by kind: " + ", ".join(f"{k} {v:.1%}" for k, v in q.by_kind.items()))
    samples = [Sample.from_dict(s) for s in profile.samples]
    rows = []
    for kind in ("decode", "mixed", "prefill", "new-shape"):
        chosen = sorted((s for s in samples if s.kind == kind), key=lambda s: s.seconds)
        for s in chosen[:: max(1, len(chosen) // 4)][:5]:
            predicted = profile.step_seconds(s.features)
            f = s.features
            rows.append(
                f"   {kind:8s} tokens {f.tokens:5d} seqs {f.seqs:3d} groups {f.decode_groups:2d} kv {f.kv_read:6d} "
                f"pairs {f.prefill_attn:8d}: measured {s.seconds * 1e3:8.2f} ms, model {predicted * 1e3:8.2f} ms "
                f"({predicted / s.seconds - 1:+.0%})"
            )
    print("\n".join(rows))
