"""The engine's steps on a GPU against the hardware's limits, each limit measured in the same run:

- decode: a pure-decode step at each of ``--batches`` requests of ``--context`` tokens, through
  the runner with and without CUDA graphs (and the graph's replay alone, without the step's host
  work: inputs, sampling), against the HBM roofline: the bytes a step cannot avoid reading (every
  matmul weight once, each request's KV) over the best read bandwidth measured here (a reduction
  over a buffer far larger than the L2, and a device-to-device copy counting both ways);
- prefill: a step of fresh prompts, ``--prefill-tokens`` in all, with and without (piecewise)
  graphs, its FLOPs over its time against the best matmul rate measured here (8192-square).

    python -m llmfleet.bench.gpu_roofline --model builtin:llama-1b --batches 1 64 --context 511

A decode step at ``--context`` writes its token at that position, so 511 gives every request 512
tokens to attend to: a whole number of KV blocks and a CUDA-graph context bucket, so the graph
pads nothing. On a CPU (``--device cpu``) it times the eager steps against that CPU's roofs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager

from llmfleet.bench.engine_bench import _sync
from llmfleet.bench.runner_profile import _best_seconds as best_of


def _best_seconds(fn, device, reps: int) -> float:
    """runner_profile's fastest of ``reps`` runs, each timed to the end of its device work."""

    def synced() -> None:
        fn()
        _sync(device)

    return best_of(synced, reps)


def read_bandwidth(device, nbytes: int = 4 << 30, reps: int = 10) -> dict[str, float]:
    """Bytes per second a step can read: a sum over ``nbytes`` of float32 (read only) and a copy
    of half of it into the other half (read and written, both counted); the roof is the higher."""
    import torch

    if device.type != "cuda":
        from llmfleet.bench.roofline import stream_bandwidth

        rate = stream_bandwidth()
        return {"sum": rate, "copy": rate, "roof": rate}
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    half = buffer.numel() // 2
    low, high = buffer[:half], buffer[half:]
    rates = {
        "sum": nbytes / _best_seconds(buffer.sum, device, reps),
        "copy": 2 * half * 4 / _best_seconds(lambda: high.copy_(low), device, reps),
    }
    return rates | {"roof": max(rates.values())}


def matmul_peak(device, dtype, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of an (n, n) x (n, n) product in ``dtype`` on random data, the best of ``reps``."""
    import torch

    if device.type != "cuda":
        from llmfleet.bench.roofline import gemm_peak

        return gemm_peak(dtype)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b, device, reps)


def decode_step_bytes(sizes: dict[str, int], batch: int, context: int) -> int:
    """Bytes a decode step must read: every matmul weight once, and ``context`` tokens of keys and
    values per request in every layer."""
    kv = batch * context * sizes["layers"] * 2 * sizes["kv_dim"] * sizes["itemsize"]
    return sizes["matmul_params"] * sizes["itemsize"] + kv


def prefill_step_flops(sizes: dict[str, int], head_params: int, prompts: int, prompt_len: int) -> float:
    """FLOPs a step of ``prompts`` fresh prompts of ``prompt_len`` tokens must do: every weight
    but the LM head for every token, the head for each prompt's last token only (the one it
    samples from), and causal attention."""
    from llmfleet.bench.roofline import prefill_flops

    tokens = prompts * prompt_len
    return prefill_flops(sizes, prompts, prompt_len) - 2 * head_params * (tokens - prompts)


class _Prompts:
    """``prompts`` fresh prompts of ``prompt_len`` tokens, each step computing all of them from
    position 0 (nothing is advanced, so every timed step does the same work)."""

    def __init__(self, runner, prompts: int, prompt_len: int, first_block: int) -> None:
        from llmfleet.server.core.batch import ScheduledRequest, SchedulerOutput
        from llmfleet.server.core.request import Request, SamplingParams

        per_request = -(-prompt_len // runner.kv_block_size)
        vocab = runner.model.config.vocab_size
        requests = []
        for i in range(prompts):
            ids = [(13 * i + 7 * j) % (vocab - 10) + 10 for j in range(prompt_len)]
            request = Request(f"p{i}", ids, SamplingParams(temperature=0, max_tokens=1))
            start = first_block + i * per_request
            request.block_table = list(range(start, start + per_request))
            requests.append(request)
        self.output = SchedulerOutput([ScheduledRequest(r, prompt_len) for r in requests])
        self.runner = runner

    def step(self) -> None:
        self.runner.execute(self.output)


@contextmanager
def _eager(runner):
    """The runner without its CUDA graphs while the block runs (decode and piecewise both)."""
    graphs, piecewise = runner.graphs, runner.piecewise
    runner.graphs = runner.piecewise = None
    try:
        yield
    finally:
        runner.graphs, runner.piecewise = graphs, piecewise


def _modes(runner) -> list[str]:
    return ["eager", "graphs"] if runner.graphs is not None else ["eager"]


def _timed_modes(runner, step, device, reps: int, rounds: int) -> dict[str, float]:
    """Best seconds of ``step`` in each mode, the modes alternated for ``rounds`` rounds."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for mode in _modes(runner):
            if mode == "eager":
                with _eager(runner):
                    seconds = _best_seconds(step, device, reps)
            else:
                seconds = _best_seconds(step, device, reps)
            best[mode] = min(best.get(mode, float("inf")), seconds)
    return best


def measure(args) -> dict:
    import torch

    from llmfleet.bench.roofline import model_sizes
    from llmfleet.bench.runner_profile import _Decoding
    from llmfleet.server.config import EngineConfig
    from llmfleet.server.runner.builtin_models import resolve_model
    from llmfleet.server.runner.torch_runner import TorchModelRunner

    device = torch.device(args.device)
    os.environ.setdefault("LLMFLEET_CUDA_GRAPHS", "lazy")  # capture only the shapes timed here
    path = resolve_model(args.model)
    bs = args.block_size
    decode_blocks = max(args.batches) * -(-(args.context + 64) // bs)
    prompts = max(tokens // min(args.prompt_len, tokens) for tokens in args.prefill_tokens)
    prefill_blocks = prompts * -(-args.prompt_len // bs)
    config = EngineConfig(
        dtype=args.dtype,
        kv_block_size=bs,
        num_kv_blocks=decode_blocks + prefill_blocks,
        max_model_len=max(args.context + 64, args.prompt_len),
    )
    started = time.perf_counter()
    runner = TorchModelRunner(path, config, device=args.device)
    load_s = time.perf_counter() - started
    sizes = model_sizes(runner.model)
    head_params = runner.model.get_output_embeddings().weight.numel()
    bandwidth = read_bandwidth(device)
    peak = matmul_peak(device, runner.dtype)
    result: dict = {
        "model": args.model,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(runner.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "load_s": load_s,
        "matmul_params": sizes["matmul_params"],
        "bandwidth": bandwidth,
        "matmul_peak": peak,
        "prefill": [],
        "decode": [],
    }
    # prompts first: their steps write the KV the decode requests prefill over afterwards
    for tokens in args.prefill_tokens:
        length = min(args.prompt_len, tokens)
        prompts = _Prompts(runner, tokens // length, length, first_block=0)
        flops = prefill_step_flops(sizes, head_params, tokens // length, length)
        seconds = _timed_modes(runner, prompts.step, device, args.reps, args.rounds)
        result["prefill"].append(
            {"tokens": tokens, "prompt_len": length, "flops": flops}
            | {f"{mode}_ms": s * 1e3 for mode, s in seconds.items()}
            | {f"{mode}_of_peak": flops / s / peak for mode, s in seconds.items()}
        )
    for batch in args.batches:
        decoding = _Decoding(runner, batch, args.context)
        step_bytes = decode_step_bytes(sizes, batch, args.context + 1)
        bound = step_bytes / bandwidth["roof"]
        seconds = _timed_modes(runner, decoding.step, device, args.reps, args.rounds)
        if runner.graphs is not None:  # the graph's GPU work alone, without the step's host work
            graph = runner.graphs.captured(runner.graphs.shape_for(decoding.make()))
            seconds["replay"] = _best_seconds(graph.graph.replay, device, args.reps)
        result["decode"].append(
            {"batch": batch, "context": args.context + 1, "bytes": step_bytes, "bound_ms": bound * 1e3}
            | {f"{mode}_ms": s * 1e3 for mode, s in seconds.items()}
            | {f"{mode}_of_roof": bound / s for mode, s in seconds.items()}
        )
        if args.profile and batch == max(args.batches):
            result["profile"] = kernel_table(runner, decoding.step, device)
        del decoding
    return result


def kernel_table(runner, step, device, steps: int = 5, rows: int = 20) -> str:
    """torch.profiler's table of the ops that took the most device time over ``steps`` eager
    steps: where a step's time goes, kernel by kernel (a graph replays the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _eager(runner):
        step()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            _sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def report(result: dict) -> str:
    bw = result["bandwidth"]
    lines = [
        f"{result['model']} ({result['matmul_params'] / 1e9:.2f}B params in matmuls) in {result['dtype']} "
        f"on {result['device']}, torch {result['torch']}, {result['date']}; loaded in {result['load_s']:.0f} s",
        f"read bandwidth {bw['roof'] / 1e12:.2f} TB/s (sum {bw['sum'] / 1e12:.2f}, copy {bw['copy'] / 1e12:.2f}); "
        f"{result['dtype']} matmul peak {result['matmul_peak'] / 1e12:.0f} TFLOP/s",
    ]
    for row in result["decode"]:
        modes = [m for m in ("eager", "graphs", "replay") if f"{m}_ms" in row]
        parts = ", ".join(f"{m} {row[f'{m}_ms']:.2f} ms ({row[f'{m}_of_roof']:.0%})" for m in modes)
        lines.append(
            f"decode batch {row['batch']} x {row['context']} tokens: roofline {row['bound_ms']:.2f} ms "
            f"({row['bytes'] / 1e9:.2f} GB); {parts} of the roofline"
        )
    for row in result["prefill"]:
        modes = [m for m in ("eager", "graphs") if f"{m}_ms" in row]
        parts = ", ".join(f"{m} {row[f'{m}_ms']:.2f} ms ({row[f'{m}_of_peak']:.0%})" for m in modes)
        lines.append(
            f"prefill {row['tokens']} tokens ({row['tokens'] // row['prompt_len']} x {row['prompt_len']}): "
            f"{row['flops'] / 1e12:.1f} TFLOP; {parts} of the matmul peak"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:llama-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[64], help="decode batch sizes")
    parser.add_argument("--context", type=int, default=511, help="tokens already in each decoding request's KV")
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[2048, 8192], help="prompt tokens a step")
    parser.add_argument("--prompt-len", type=int, default=1024, help="tokens per prompt in a prefill step")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="eager and graphs alternated this many times")
    parser.add_argument("--profile", action="store_true", help="print the largest decode batch's kernels")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    result = measure(args)
    print(report(result))
    if "profile" in result:
        print(f"\neager decode at batch {max(args.batches)}, 5 steps:\n{result['profile']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
