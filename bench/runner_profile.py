"""Quick perf sanity for the torch runner (not a test, not the full benchmark).

Times one pure-decode step of ``TorchModelRunner.execute`` at several batch sizes and compares
it with two floors and a ceiling measured in the same run on the same shapes:

- linear floor: the model's own Linear layers applied to a (batch, in_features) input, one after
  the other, i.e. the matmul work a decode step cannot avoid (memory-bound at batch 1,
  compute-bound at batch 32);
- HF forward: the HF model forward with the same batch and no KV cache at all (eager
  attention over one token), i.e. what the framework costs before any paged attention;

and with the engine bench's "ceiling": the model's matmul FLOPs at its measured GEMM peak
(bench/roofline.py), which small-batch decode matmuls cannot reach on a CPU.

    python -m llmfleet.bench.runner_profile --model builtin:small --dtype auto --batches 1 8 32
    python -m llmfleet.bench.runner_profile --profile 32   # torch.profiler table for batch 32
    python -m llmfleet.bench.runner_profile --parts        # each step split into its parts

A step runs as the engine runs it: where the model takes it, through the C decode layers
(server/runner/cpu_decode.py); the "modules ms" column times the same step through the model's
modules, and ``--parts`` splits those (the C call has no parts to time from Python).

``--parts`` splits the fastest of the timed steps into what a step's time goes to: the linear
layers, the paged attention (cache writes and kernels), the other ops of the forward (norms,
rotary embedding, activations, residual adds, the module calls) and the runner's own work
outside the forward (step inputs, sampling). The parts are wall times of the step itself, not
a profiler's estimates, so they add up to the step. A second table times the step again with
the linears, the attention, and both made free: what each would save, and what is left without
them (the timed parts put some of the linears' cost, such as the caches they evict, under the
other ops).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from collections import Counter


def _best_seconds(fn, reps: int) -> float:
    """Fastest of ``reps`` runs: on a shared machine the minimum is the least disturbed."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class _Decoding:
    """``batch`` requests prefilled to ``context`` (+ up to ``spread``) tokens; each step decodes
    one token for each of them and then rolls it back, so every timed step does the same work."""

    def __init__(self, runner, batch: int, context: int, spread: int = 0) -> None:
        from llmfleet.server.core.batch import ScheduledRequest, SchedulerOutput
        from llmfleet.server.core.request import Request, SamplingParams

        self.runner = runner
        bs = runner.kv_block_size
        per_request = -(-(context + spread + 64) // bs)
        vocab = runner.model.config.vocab_size
        if batch * per_request > runner.num_kv_blocks:
            raise SystemExit(f"needs {batch * per_request} KV blocks, the runner has {runner.num_kv_blocks}")
        free = list(range(runner.num_kv_blocks))
        random.Random(0).shuffle(free)  # scattered block tables, as a busy block manager hands out
        self.requests = []
        for i in range(batch):
            length = context + (spread * i // max(1, batch - 1))
            prompt = [(7 * i + j) % (vocab - 10) + 10 for j in range(length)]
            request = Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=64))
            request.block_table = [free.pop() for _ in range(per_request)]
            self.requests.append(request)
        # prefill a few requests at a time so the warm-up stays cheap
        for start in range(0, batch, 4):
            group = self.requests[start : start + 4]
            self._advance(SchedulerOutput([ScheduledRequest(r, r.num_tokens) for r in group]))
        self.make = lambda: SchedulerOutput([ScheduledRequest(r, 1) for r in self.requests])

    def _advance(self, output) -> None:
        tokens = self.runner.execute(output)
        for item, token in zip(output.scheduled, tokens, strict=True):
            item.request.num_computed_tokens += item.num_tokens
            item.request.output_token_ids.append(token.token_id)

    def step(self) -> None:
        self._advance(self.make())
        # stay at the same context length so every timed step does the same work
        for r in self.requests:
            r.output_token_ids.pop()
            r.num_computed_tokens -= 1


@contextlib.contextmanager
def timed_parts(runner, seconds: Counter):
    """Adds each call's wall time to ``seconds`` under its part while the block runs: the runner's
    steps, the model's forwards, its linear layers (packed or plain) and the paged attention."""
    import torch

    from llmfleet.server.runner import attention
    from llmfleet.server.runner.cpu_linear import PackedLinear

    def timing(function, part):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start

        return timed

    parts = [
        (PackedLinear, "forward", "linear"),
        (torch.nn.Linear, "forward", "linear"),
        (attention, "attend", "attention"),
        (runner.model, "forward", "forward"),
        (runner, "execute", "step"),
    ]
    with _patched([(owner, name, timing(getattr(owner, name), part)) for owner, name, part in parts]):
        yield


@contextlib.contextmanager
def _patched(replacements: list):
    """Sets each (owner, name, replacement) while the block runs, then puts back what was there."""
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in replacements]
    for owner, name, replacement in replacements:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)  # an instance's method: its class's comes back
            else:
                setattr(owner, name, original)


@contextlib.contextmanager
def modules_only(runner):
    """While the block runs, decode steps go through the model's modules, not the C decode layers."""
    fused, runner.fused_decode = runner.fused_decode, None
    try:
        yield
    finally:
        runner.fused_decode = fused


def step_parts(decoding, reps: int) -> dict[str, float]:
    """The fastest of ``reps`` steps through the modules, in milliseconds, split into its parts
    (``--parts``)."""
    best: Counter = Counter()
    seconds: Counter = Counter()
    with modules_only(decoding.runner), timed_parts(decoding.runner, seconds):
        decoding.step()
        for _ in range(reps):
            seconds.clear()
            decoding.step()
            if not best or seconds["step"] < best["step"]:
                best = Counter(seconds)
    ms = {part: value * 1e3 for part, value in best.items()}
    return {
        "step": ms["step"],
        "linear": ms["linear"],
        "attention": ms["attention"],
        "other ops": ms["forward"] - ms["linear"] - ms["attention"],
        "outside fwd": ms["step"] - ms["forward"],
    }


@contextlib.contextmanager
def free_parts(*parts: str):
    """While the block runs, the named parts ("linear", "attention") cost nothing: each linear
    hands back a zero tensor of its output's shape, made once per shape, and the paged
    attention leaves its output buffer as it is. The outputs are wrong; only the timing counts."""
    import torch

    from llmfleet.server.runner import attention
    from llmfleet.server.runner.cpu_linear import PackedLinear

    outputs: dict = {}

    def free_linear(self, x):
        key = (x.shape, x.dtype, self.out_features)
        if key not in outputs:
            outputs[key] = torch.zeros(*x.shape[:-1], self.out_features, dtype=x.dtype)
        return outputs[key]

    stand_ins = []
    if "linear" in parts:
        stand_ins += [(PackedLinear, "forward", free_linear), (torch.nn.Linear, "forward", free_linear)]
    if "attention" in parts:
        stand_ins.append((attention, "attend", lambda *args, **kwargs: None))
    with _patched(stand_ins):
        yield


def parts_by_removal(decoding, reps: int) -> dict[str, float]:
    """Each part's cost as what the step saves when that part costs nothing (``--parts``), in
    milliseconds: the step, then without its linears, without its attention and without both.
    Unlike the timed parts, a part's saving here includes what it makes the others wait for
    (caches it evicts, threads it leaves to wake), so the three need not add up to the step."""
    with modules_only(decoding.runner):
        step = _best_seconds(decoding.step, reps)
        without = {}
        for parts in (("linear",), ("attention",), ("linear", "attention")):
            with free_parts(*parts):
                without[parts] = _best_seconds(decoding.step, reps)
    return {
        "step": step * 1e3,
        "linear": (step - without[("linear",)]) * 1e3,
        "attention": (step - without[("attention",)]) * 1e3,
        "the rest": without[("linear", "attention")] * 1e3,
    }


def model_linears(model) -> list:
    """The model's linear layers as its runner runs them: plain or oneDNN-packed."""
    import torch

    from llmfleet.server.runner.cpu_linear import PackedLinear

    return [m for m in model.modules() if isinstance(m, torch.nn.Linear | PackedLinear)]


def linear_floor(model, batch: int, reps: int) -> float:
    import torch

    linears = model_linears(model)
    dtype = linears[0].weight.dtype
    inputs = {m.in_features: torch.randn(batch, m.in_features, dtype=dtype) for m in linears}

    @torch.inference_mode()
    def run() -> None:
        for m in linears:
            m(inputs[m.in_features])

    return _best_seconds(run, reps)


def forward_floor(model_dir, dtype, batch: int, reps: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()
    ids = torch.randint(10, model.config.vocab_size - 10, (batch, 1))

    @torch.inference_mode()
    def run() -> None:
        model(input_ids=ids, use_cache=False)

    return _best_seconds(run, reps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=192, help="tokens already in each request's KV")
    parser.add_argument("--spread", type=int, default=0, help="contexts spread over context..context+spread")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--profile", type=int, metavar="BATCH", help="print a torch.profiler table at this batch")
    parser.add_argument("--parts", action="store_true", help="split each batch's step into its parts")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from llmfleet.bench.roofline import gemm_peak
    from llmfleet.server.config import EngineConfig
    from llmfleet.server.runner.builtin_models import resolve_model
    from llmfleet.server.runner.torch_runner import TorchModelRunner

    path = resolve_model(args.model)
    per_request = -(-(args.context + args.spread + 64) // args.block_size)
    blocks = max([*args.batches, args.profile or 0]) * per_request
    config = EngineConfig(dtype=args.dtype, kv_block_size=args.block_size, num_kv_blocks=blocks)
    runner = TorchModelRunner(path, config)
    linear_params = sum(m.weight.numel() for m in model_linears(runner.model))
    gflops = gemm_peak(runner.dtype) / 1e9
    print(
        f"model {args.model}: {linear_params / 1e6:.1f}M params in matmuls, {runner.dtype}, "
        f"{torch.get_num_threads()} threads, context {args.context}+{args.spread}, block size {args.block_size}; "
        f"square matmul {gflops:.0f} GFLOP/s"
    )
    header = ("batch", "step ms", "modules ms", "tok/s", "linear ms", "hf fwd ms", "step/linear", "vs ceiling")
    print(" ".join(f"{h:>11}" for h in header))
    parts_by_batch = []
    for batch in args.batches:
        decoding = _Decoding(runner, batch, args.context, args.spread)
        step = _best_seconds(decoding.step, args.reps)
        with modules_only(runner):
            modules = _best_seconds(decoding.step, args.reps)
        if args.parts:  # the same prefilled requests, timed part by part, then each part removed
            parts_by_batch.append((batch, step_parts(decoding, args.reps), parts_by_removal(decoding, args.reps)))
        floor = linear_floor(runner.model, batch, args.reps)
        fwd = forward_floor(path, runner.dtype, batch, max(3, args.reps // 2))
        ceiling = 2 * linear_params * batch / (gflops * 1e9)  # seconds at the square-matmul rate
        row = (batch, f"{step * 1e3:.1f}", f"{modules * 1e3:.1f}", f"{batch / step:.0f}", f"{floor * 1e3:.1f}")
        row += (f"{fwd * 1e3:.1f}",)
        row += (f"{step / floor:.2f}", f"{ceiling / step:.0%}")
        print(" ".join(f"{v:>11}" for v in row))
    if args.parts:
        print("\nms per step through the modules, the fastest step split into its parts")
        names = ("step", "linear", "attention", "other ops", "outside fwd")
        print(" ".join(f"{h:>11}" for h in ("batch", *names)))
        for batch, parts, _ in parts_by_batch:
            print(" ".join(f"{v:>11}" for v in (batch, *(f"{parts[n]:.1f}" for n in names))))
        print("\nms per step each part saves when it costs nothing; the rest: the step without both")
        names = ("step", "linear", "attention", "the rest")
        print(" ".join(f"{h:>11}" for h in ("batch", *names)))
        for batch, _, removed in parts_by_batch:
            print(" ".join(f"{v:>11}" for v in (batch, *(f"{removed[n]:.1f}" for n in names))))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        decoding = _Decoding(runner, args.profile, args.context, args.spread)
        decoding.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                decoding.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
