"""Engine benchmark: contenders side by side in one run, ratios printed, JSON and PNG written.

1. offline-32: llm-fleet's engine vs HF ``generate`` (default dynamic cache, one padded batch)
   vs transformers' continuous batching (``generate_batch``). Useful tokens only: the HF
   contenders run every sequence to the longest output, only the requested tokens count.
2. decode ceiling: pure decode at batch 32 vs the matmul ceiling measured in the same run.
3. structured output: the offline workload again, plain vs every request held to a JSON object
   grammar (the sampler's mask per step), same engine.
4. prefix caching: 16 requests sharing a 384-token system prompt, caching on vs off.
5. scheduler: ``schedule()`` time with 256 running requests.
6. anyscale-online: static vs dynamic vs continuous policies, real-time Poisson arrivals.
7. on a GPU, piecewise CUDA graphs: the steps that carry prompt tokens, eager vs through the
   graph pieces, alternated on one engine.
8. on a CPU, the C attention kernels against the torch paths, alternated: decode attention
   (read in place vs gather, then matmuls) in pure decode at batch 32 (192-token contexts) and
   16 (768); prompt attention (vs SDPA) in one prompt's prefill of 512 and 2048 tokens.
9. on a CPU, the roofline: decode at batch 32 against the memory-bandwidth bound and the
   compute bound, and a prompt step against the GEMM peak, all measured in the same run
   (bench/roofline.py), at each of ``--thread-counts``.
10. ``--with-vllm`` (``--only-vllm``: this and 9 alone): vLLM's CPU build against llm-fleet, each
   in a fresh process, offline-32, anyscale-online and lone prompts of 128 to 2048 tokens,
   alternated, at each of ``--thread-counts`` (bench/vllm_contender.py).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from llmfleet.bench.machine import wait_quiet
from llmfleet.bench.report import Trace, latency_summary, print_table, save_plot
from llmfleet.server.config import EngineConfig
from llmfleet.server.core.request import SamplingParams, StructuredOutput
from llmfleet.workloads import OFFLINE_32, Workload, anyscale_online, prompt_tokens


def _load_hf(model_dir, dtype, attn="sdpa", device="cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
    return model.to(device).eval()


def _sync(device) -> None:
    """Wait for queued GPU work, so a timer reads the work's end and not its launch."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def offline_ours(model: str, prompts, outputs, warm, dtype: str, device: str | None = None) -> tuple[float, object]:
    from llmfleet.server.engine.build import build_engine

    config = EngineConfig(dtype=dtype, max_batch_size=32, max_num_batched_tokens=2048)
    engine, _ = build_engine(model, config, device=device)
    engine.generate(warm, SamplingParams(max_tokens=2, temperature=0))  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - start, engine


def grammar_overhead(engine, prompts, outputs, rounds: int = 2) -> dict[str, float]:
    """Best seconds of the offline workload, plain and with every request held to a JSON object
    grammar, alternated on one engine (a mask per step per request; the lengths stay fixed)."""
    best = {"plain": float("inf"), "json_object": float("inf")}
    for _ in range(rounds):
        for name, structured in (("plain", None), ("json_object", StructuredOutput("json_object"))):
            params = [
                SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, structured=structured) for n in outputs
            ]
            start = time.perf_counter()
            engine.generate(prompts, params)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def json_object_speed(best: dict[str, float]) -> float:
    """Throughput held to a JSON object over plain throughput (below 1: the grammar costs)."""
    return best["plain"] / best["json_object"]


def shared_prefix(model: str, dtype: str, device: str | None, vocab: int, rounds: int = 2) -> dict[str, float]:
    """Best seconds of 16 requests that share a 384-token system prompt (32 tokens of their own,
    16 out), once the system prompt has been seen: prefix caching on vs off, alternated."""
    from llmfleet.server.engine.build import build_engine

    rng = random.Random(0)
    system = [rng.randrange(10, vocab) for _ in range(384)]
    prompts = [system + [rng.randrange(10, vocab) for _ in range(32)] for _ in range(16)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engines = {
        name: build_engine(model, EngineConfig(dtype=dtype, max_batch_size=16, enable_prefix_caching=on), device)[0]
        for name, on in (("cached", True), ("uncached", False))
    }
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(rounds):
        for name, engine in engines.items():
            engine.generate([[*system, 1]], SamplingParams(max_tokens=1, temperature=0))
            start = time.perf_counter()
            engine.generate(prompts, params)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def offline_hf_generate(model_dir, prompts, outputs, warm, torch_dtype, device="cpu") -> float:
    import torch

    model = _load_hf(model_dir, torch_dtype, device=device)
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    warm_ids = torch.tensor(warm, device=device)
    longest = max(outputs)
    with torch.inference_mode():
        model.generate(warm_ids, attention_mask=torch.ones_like(warm_ids), max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
        )
        _sync(device)
    return time.perf_counter() - start


def offline_hf_generate_batch(model_dir, prompts, outputs, warm, torch_dtype, device="cpu") -> float:
    from transformers import GenerationConfig

    model = _load_hf(model_dir, torch_dtype, device=device)
    longest = max(outputs)
    config = GenerationConfig(
        max_new_tokens=longest, min_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    warm_config = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=warm, generation_config=warm_config, progress_bar=False)  # warm-up, as the others
    start = time.perf_counter()  # generate_batch manages its own inference mode
    results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in results.values())
    if len(results) != len(prompts) or produced < sum(outputs):
        raise RuntimeError(f"generate_batch returned {produced} tokens for {len(results)} of {len(prompts)} requests")
    return elapsed


def matmul_gflops(torch_dtype, n: int = 1536, device="cpu") -> float:
    import torch

    a = torch.randn(n, n, dtype=torch_dtype, device=device)
    b = torch.randn(n, n, dtype=torch_dtype, device=device)
    a @ b
    _sync(device)
    start = time.perf_counter()
    reps = 5 if torch.device(device).type == "cpu" else 200
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


def decode_at_batch(engine, batch: int = 32, context: int = 192, steps: int = 24) -> float:
    """Tokens/s of steady-state decode with ``batch`` running requests."""
    vocab = engine.runner.model.config.vocab_size
    for i in range(batch):
        prompt = [(7 * i + j) % (vocab - 10) + 10 for j in range(context)]
        engine.add_request(f"dec-{i}", prompt, SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0))
    while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
        engine.step()  # prefill everything first
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    for i in range(batch):
        engine.abort_request(f"dec-{i}")
    engine.step()
    return batch * steps / elapsed


@contextlib.contextmanager
def _cpu_kernels(flag: str):
    """``LLMFLEET_CPU_KERNELS`` set to ``flag`` for the block (it is read at every call)."""
    before = os.environ.get("LLMFLEET_CPU_KERNELS")
    os.environ["LLMFLEET_CPU_KERNELS"] = flag
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LLMFLEET_CPU_KERNELS", None)
        else:
            os.environ["LLMFLEET_CPU_KERNELS"] = before


def decode_kernel(engine, batch: int, context: int, rounds: int = 3) -> dict[str, float]:
    """Best decode tok/s at ``batch`` through the C decode-attention kernel and through the torch
    path, alternated on one engine."""
    best = {"kernel": 0.0, "torch": 0.0}
    for _ in range(rounds):
        for name, flag in (("kernel", "1"), ("torch", "0")):
            with _cpu_kernels(flag):
                best[name] = max(best[name], decode_at_batch(engine, batch, context, steps=12))
    return best


def prompt_kernel(engine, prompt_len: int, rounds: int = 3) -> dict[str, float]:
    """Best seconds of one fresh ``prompt_len``-token prompt's prefill (and its first token)
    through the C prompt-attention kernel and through torch's SDPA, alternated on one engine. The
    kernel's arm takes the kernel even where the engine would send the prompt to SDPA first
    (bfloat16 on CPUs with AMX: attention.sdpa_first)."""
    from llmfleet.server.runner import attention

    vocab = engine.runner.model.config.vocab_size
    best = {"kernel": float("inf"), "torch": float("inf")}
    sdpa_first = attention.sdpa_first
    for _ in range(rounds):
        for name, flag in (("kernel", "1"), ("torch", "0")):
            rng = random.Random(next(_FRESH_PROMPTS))  # never a prompt this engine has cached
            ids = [rng.randrange(10, vocab) for _ in range(prompt_len)]
            attention.sdpa_first = (lambda q, scoring: False) if name == "kernel" else sdpa_first
            try:
                with _cpu_kernels(flag):
                    start = time.perf_counter()
                    engine.generate([ids], SamplingParams(max_tokens=1, temperature=0))
                    best[name] = min(best[name], time.perf_counter() - start)
            finally:
                attention.sdpa_first = sdpa_first
    return best


def piecewise_graphs(engine, prompts, outputs, rounds: int = 2) -> dict[str, float]:
    """Best median milliseconds of the steps that carry prompt tokens, run eagerly and through the
    piecewise CUDA graphs, alternated on one engine (pure decode steps take their decode graphs
    in both)."""
    runner = engine.runner
    pieces, execute = runner.piecewise, runner.execute
    times: list[float] = []

    def timed(output):
        _sync("cuda")
        start = time.perf_counter()
        sampled = execute(output)
        _sync("cuda")
        if any(item.num_tokens > 1 or item.start == 0 for item in output.scheduled):
            times.append(time.perf_counter() - start)
        return sampled

    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outputs]
    best = {"eager": float("inf"), "piecewise": float("inf")}
    runner.execute = timed
    try:
        for _ in range(rounds):
            for name, graphs in (("eager", None), ("piecewise", pieces)):
                runner.piecewise = graphs
                times.clear()
                engine.generate(prompts, params)
                best[name] = min(best[name], statistics.median(times) * 1e3)
    finally:
        runner.piecewise, runner.execute = pieces, execute
    return best


def warm_up_effect(model: str, dtype: str, rounds: int = 2) -> dict[str, float]:
    """Fresh processes (bench/warm_up_probe.py), with and without the start-up warm-up,
    alternated ``rounds`` times: the mean of each one's build and first and second passes over
    every padded step size (a prompt each)."""
    import json
    import os
    import subprocess
    import sys

    runs: dict[str, list[dict[str, float]]] = {"warmed": [], "cold": []}
    for _ in range(rounds):
        for name, switch in (("cold", "0"), ("warmed", "1")):
            env = {**os.environ, "LLMFLEET_WARM_UP": switch}
            out = subprocess.run(
                [sys.executable, "-m", "llmfleet.bench.warm_up_probe", model, dtype],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    return {
        f"{name}_{key}": sum(r[key] for r in done) / len(done)
        for name, done in runs.items()
        for key in ("build_s", "first_pass_s", "second_pass_s")
    }


_FRESH_PROMPTS = itertools.count(1000)  # seeds of the roofline's prompts, one per prompt step


def roofline(engine, torch_dtype, threads: int, batch: int = 32, context: int = 192, offline=None) -> dict:
    """Decode at ``batch`` against the memory-bandwidth and compute bounds and a 2048-token prompt
    step against the GEMM peak, the ceilings measured here at ``threads`` threads (bench/roofline.py);
    with ``offline`` (a Workload), the useful tok/s no engine could beat on it here."""
    import torch

    from llmfleet.bench import roofline as rl

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pressure = wait_quiet(max_wait_s=30)
        bandwidth = rl.stream_bandwidth()
        peak = rl.gemm_peak(torch_dtype)
        sizes = rl.model_sizes(engine.runner.model)
        steps = 24
        decode = decode_at_batch(engine, batch=batch, context=context, steps=steps)
        bound = rl.decode_bound_tok_s(sizes, batch, context + steps // 2, bandwidth)
        compute_bound = rl.decode_compute_bound_tok_s(sizes, batch, context + steps // 2, peak)
        vocab = engine.runner.model.config.vocab_size
        prompts, prompt_len = 16, 128
        best = float("inf")
        for _ in range(2):
            rng = random.Random(next(_FRESH_PROMPTS))  # never a prompt this engine has cached
            ids = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(prompts)]
            start = time.perf_counter()
            engine.generate(ids, SamplingParams(max_tokens=1, temperature=0))
            best = min(best, time.perf_counter() - start)
        prefill_flops = rl.prefill_flops(sizes, prompts, prompt_len)
        floor = {}
        if offline is not None:
            specs = offline.requests()
            outputs = [s.output_len for s in specs]
            seconds = rl.offline_floor_s(sizes, [s.prompt_len for s in specs], outputs, bandwidth, peak)
            floor = {"offline_workload": offline.name, "offline_floor_tok_s": sum(outputs) / seconds}
    finally:
        torch.set_num_threads(before)
    return {
        "threads": threads,
        "pressure_before": pressure,
        "stream_gb_s": bandwidth / 1e9,
        "gemm_peak_gflops": peak / 1e9,
        "decode_batch": batch,
        "decode_tok_s": decode,
        "decode_bound_tok_s": bound,
        "decode_of_bound": decode / bound,
        "decode_compute_bound_tok_s": compute_bound,
        "decode_of_roof": decode / min(bound, compute_bound),
        "prefill_tokens": prompts * prompt_len,
        "prefill_gflops": prefill_flops / best / 1e9,
        "prefill_of_peak": prefill_flops / best / peak,
        **floor,
    }


def print_roofline(r: dict) -> None:
    print(
        f"== roofline, {r['threads']} thread(s): decode at batch {r['decode_batch']} {r['decode_tok_s']:.0f} tok/s "
        f"vs {r['decode_bound_tok_s']:.0f} memory-bound ({r['stream_gb_s']:.1f} GB/s streamed) -> "
        f"{r['decode_of_bound']:.0%}, and {r['decode_compute_bound_tok_s']:.0f} compute-bound (the GEMM peak) -> "
        f"{r['decode_of_roof']:.0%} of the lower roof; "
        f"prefill of {r['prefill_tokens']} tokens {r['prefill_gflops']:.0f} GFLOP/s vs "
        f"{r['gemm_peak_gflops']:.0f} GEMM peak -> {r['prefill_of_peak']:.0%}"
    )
    if "offline_floor_tok_s" in r:
        print(
            f"   {r['offline_workload']} can run at most {r['offline_floor_tok_s']:.0f} useful tok/s here "
            "(its prompts at the GEMM peak, each decode step at the lower roof)"
        )


def scheduler_time_256() -> float:
    """Mean seconds of one ``schedule()`` call with 256 running decode requests."""
    from llmfleet.server.core.block_manager import BlockManager
    from llmfleet.server.core.request import Request
    from llmfleet.server.core.scheduler import Scheduler

    config = EngineConfig(max_batch_size=256, max_num_batched_tokens=4096)
    scheduler = Scheduler(config, BlockManager(256 * 64, 16))
    for i in range(256):
        scheduler.add(Request(str(i), list(range(300)), SamplingParams(max_tokens=500)))
    scheduler.schedule()
    reps = 200
    spent = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        out = scheduler.schedule()
        spent += time.perf_counter() - start
        for item in out.scheduled:  # what postprocess does (untimed): computed, one more owed
            req = item.request
            req.num_computed_tokens += item.num_tokens
            req.output_token_ids.append(1)
    return spent / reps


def online(model: str, workload: Workload, config: EngineConfig, device: str | None = None) -> dict:
    from llmfleet.server.engine.build import build_engine

    engine, _ = build_engine(model, config, device=device)
    vocab = engine.runner.model.config.vocab_size
    specs = workload.requests()
    traces: dict[str, Trace] = {}
    pending = list(enumerate(specs))
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][1].arrival_s <= now:
            i, spec = pending.pop(0)
            rid = str(i)
            engine.add_request(
                rid,
                prompt_tokens(spec, i, vocab),
                SamplingParams(max_tokens=spec.output_len, temperature=0, ignore_eos=True),
                arrival_time=start + spec.arrival_s,
            )
            traces[rid] = Trace(spec.arrival_s, spec.prompt_len)
        if not pending:
            engine.flush()  # static/dynamic: the last partial batch
        events = engine.step()
        t = time.monotonic() - start
        for ev in events:
            traces[ev.request_id].token_times.extend([t] * len(ev.new_token_ids))
        if not events and not engine.scheduler.running:
            wake = [pending[0][1].arrival_s + start] if pending else []
            if engine.next_wakeup() is not None:
                wake.append(engine.next_wakeup())
            if wake:
                time.sleep(max(0.0, min(wake) - time.monotonic()))
    total = time.monotonic() - start
    return latency_summary(list(traces.values()), total)


def run(args) -> int:
    import torch

    from llmfleet.server.runner import cpu_kernels
    from llmfleet.server.runner.builtin_models import resolve_model
    from llmfleet.server.runner.torch_runner import resolve_device, resolve_dtype

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(args.model)
    device = resolve_device(getattr(args, "device", None) or "cpu")
    torch_dtype = resolve_dtype(EngineConfig(dtype=args.dtype).dtype, device)  # the config's names and vLLM's
    dtype_name = str(torch_dtype).removeprefix("torch.")
    results: dict = {
        "model": args.model,
        "dtype": dtype_name,
        "device": str(device),
        "threads": torch.get_num_threads(),
    }

    workload = OFFLINE_32 if not args.quick else Workload("offline-8", 8, prompt_len=(128, 128), output_len=(16, 64))
    specs = workload.requests()
    vocab = _vocab(model_dir)
    prompts = [prompt_tokens(s, i, vocab) for i, s in enumerate(specs)]
    warm = [prompt_tokens(s, i, vocab, seed=1) for i, s in enumerate(specs[:2])]  # no cached prefix of prompts
    outputs = [s.output_len for s in specs]
    useful = sum(outputs)
    print(
        f"== {workload.name}: {workload.description or workload.params()} | model {args.model} {dtype_name} on {device}"
    )

    threads_list = args.thread_counts or [torch.get_num_threads()]
    if args.with_vllm or args.only_vllm:
        from llmfleet.bench import vllm_contender

        online_wl = anyscale_online(args.rate, args.online_requests)
        try:
            context = vllm_contender.context_for(model_dir, (workload, online_wl))
        except ValueError as exc:
            print(f"llm-fleet bench engine: {exc}", file=sys.stderr)
            return 2
        setup = vllm_contender.Setup(str(model_dir), dtype_name, max_model_len=context)
        print(f"== llm-fleet vs vLLM CPU: {workload.name} and {online_wl.name} ({online_wl.description})")
        try:
            compared = vllm_contender.compare(setup, threads_list, workload, online_wl, vocab, args.rounds, out_dir)
        except vllm_contender.ContenderError as exc:
            print(f"llm-fleet bench engine: {exc}", file=sys.stderr)
            return 1
        results["vllm"] = compared
    if args.only_vllm:
        from llmfleet.server.engine.build import build_engine

        config = EngineConfig(dtype=dtype_name, max_batch_size=32, max_num_batched_tokens=2048)
        engine, _ = build_engine(args.model, config, device=str(device))
        results["roofline"] = [roofline(engine, torch_dtype, n, offline=workload) for n in threads_list]
        for r in results["roofline"]:
            print_roofline(r)
        (out_dir / "engine_bench.json").write_text(json.dumps(results, indent=2))
        print(f"wrote {out_dir / 'engine_bench.json'}")
        return 0

    ours_s, engine = offline_ours(args.model, prompts, outputs, warm, dtype_name, str(device))
    rows = [("llm-fleet engine (continuous, chunked)", ours_s)]
    if not args.skip_hf:
        rows.append(
            ("HF generate (dynamic cache)", offline_hf_generate(model_dir, prompts, outputs, warm, torch_dtype, device))
        )
        try:
            rows.append(
                (
                    "HF generate_batch (continuous)",
                    offline_hf_generate_batch(model_dir, prompts, outputs, warm, torch_dtype, device),
                )
            )
        except Exception as exc:  # report, don't hide: the table says why it is missing
            print(f"generate_batch failed: {type(exc).__name__}: {exc}")
    offline = [
        {"contender": name, "seconds": s, "useful_tok_s": useful / s, "ours_vs_this": s / ours_s} for name, s in rows
    ]
    results["offline"] = {"workload": workload.params(), "useful_tokens": useful, "rows": offline}
    print_table(
        ["contender", "seconds", "useful tok/s", "llm-fleet speed-up"],
        [
            [r["contender"], f"{r['seconds']:.1f}", f"{r['useful_tok_s']:.1f}", f"{r['ours_vs_this']:.2f}x"]
            for r in offline
        ],
    )

    grammar = grammar_overhead(engine, prompts, outputs)
    speed = json_object_speed(grammar)
    results["structured_output"] = {**grammar, "json_object_speed_vs_plain": speed}
    print(
        f"== structured output, {workload.name} held to a JSON object: {useful / grammar['json_object']:.1f} tok/s "
        f"vs {useful / grammar['plain']:.1f} plain -> {speed:.2f}x"
    )

    prefix = shared_prefix(args.model, dtype_name, str(device), vocab)
    results["prefix_caching"] = {**prefix, "speed_up": prefix["uncached"] / prefix["cached"]}
    print(
        f"== prefix caching, 16 requests sharing a 384-token system prompt: {prefix['cached']:.2f} s cached vs "
        f"{prefix['uncached']:.2f} s uncached -> {prefix['uncached'] / prefix['cached']:.2f}x"
    )

    gflops = matmul_gflops(torch_dtype, device=device)
    params = sum(p.numel() for p in engine.runner.model.parameters())
    ceiling = gflops * 1e9 / (2 * params)
    batch = 32 if not args.quick else 8
    decode = decode_at_batch(engine, batch=batch)
    results["decode"] = {
        "matmul_gflops": gflops,
        "params": params,
        "ceiling_tok_s": ceiling,
        "decode_tok_s": decode,
        "batch": batch,
    }
    print(
        f"== pure decode, batch {batch}: {decode:.0f} tok/s; matmul ceiling {ceiling:.0f} tok/s "
        f"({gflops:.0f} GFLOP/s x {params / 1e6:.0f}M params) -> {decode / ceiling:.0%} of ceiling"
    )

    if device.type == "cpu":
        results["roofline"] = [roofline(engine, torch_dtype, n, batch=batch, offline=workload) for n in threads_list]
        for r in results["roofline"]:
            print_roofline(r)

    if device.type == "cpu" and cpu_kernels.enabled() and cpu_kernels.built() and not args.quick:
        results["decode_kernel"] = {}
        for batch, context in ((32, 192), (16, 768)):  # 16 x 768 still fits an fp32 cache of 1 GiB
            tok_s = decode_kernel(engine, batch, context)
            results["decode_kernel"][f"{batch}x{context}"] = tok_s
            print(
                f"== decode attention at batch {batch}, {context}-token contexts: {tok_s['kernel']:.0f} tok/s with "
                f"the C kernel vs {tok_s['torch']:.0f} with the torch gather -> {tok_s['kernel'] / tok_s['torch']:.2f}x"
            )
        results["prompt_kernel"] = {}
        for prompt_len in (512, 2048):
            seconds = prompt_kernel(engine, prompt_len)
            results["prompt_kernel"][str(prompt_len)] = seconds
            print(
                f"== a {prompt_len}-token prompt's prefill: {seconds['kernel'] * 1e3:.0f} ms with the C attention "
                f"kernel vs {seconds['torch'] * 1e3:.0f} ms with torch's SDPA -> "
                f"{seconds['torch'] / seconds['kernel']:.2f}x"
            )

    if engine.runner.piecewise is not None:
        mixed = anyscale_online(args.rate, 64).requests()
        ms = piecewise_graphs(
            engine, [prompt_tokens(s, i, vocab) for i, s in enumerate(mixed)], [s.output_len for s in mixed]
        )
        results["piecewise_graphs_ms"] = ms
        print(
            f"== steps with prompt tokens (anyscale-online's 64 requests at once, 2048-token budget): "
            f"{ms['eager']:.1f} ms eager vs {ms['piecewise']:.1f} ms through piecewise CUDA graphs "
            f"-> {ms['eager'] / ms['piecewise']:.2f}x"
        )

    if engine.runner.pad_steps and not args.quick:
        warm = warm_up_effect(args.model, dtype_name)
        results["warm_up"] = warm
        print(
            f"== start-up warm-up (fresh processes, a prompt of each padded step size up to 512 tokens, twice): "
            f"first pass {warm['warmed_first_pass_s']:.2f} s warmed vs {warm['cold_first_pass_s']:.2f} s cold "
            f"-> {warm['cold_first_pass_s'] / warm['warmed_first_pass_s']:.2f}x (second pass "
            f"{warm['warmed_second_pass_s']:.2f} vs {warm['cold_second_pass_s']:.2f} s); start-up "
            f"{warm['warmed_build_s']:.1f} s vs {warm['cold_build_s']:.1f} s"
        )

    sched = scheduler_time_256()
    results["scheduler_ms_256_running"] = sched * 1e3
    print(f"== schedule() with 256 running requests: {sched * 1e3:.3f} ms")

    if not args.skip_online:
        wl = anyscale_online(args.rate, args.online_requests)
        print(f"== {wl.name}: {wl.description}, {wl.num_requests} requests")
        policies = {
            "static": EngineConfig(policy="static", max_batch_size=args.batch),
            "dynamic": EngineConfig(policy="dynamic", max_batch_size=args.batch, batch_timeout_ms=500),
            "continuous": EngineConfig(policy="continuous", max_batch_size=args.batch, max_num_batched_tokens=512),
        }
        online_rows = {}
        for name, config in policies.items():
            config = config.model_copy(update={"dtype": dtype_name})
            online_rows[name] = online(args.model, wl, config, str(device))
        base = online_rows["static"]
        print_table(
            [
                "policy",
                "tok/s",
                "vs static",
                "TTFT p50",
                "TTFT p99",
                "ITL p50",
                "ITL p99",
                "e2e p50",
                "goodput req/s",
            ],
            [
                [
                    name,
                    f"{r['throughput_tok_s']:.1f}",
                    f"{r['throughput_tok_s'] / base['throughput_tok_s']:.2f}x",
                    f"{r['ttft_p50']:.2f}s",
                    f"{r['ttft_p99']:.2f}s",
                    f"{r['itl_p50'] * 1e3:.0f}ms",
                    f"{r['itl_p99'] * 1e3:.0f}ms",
                    f"{r['e2e_p50']:.2f}s",
                    f"{r['goodput_req_s']:.2f}",
                ]
                for name, r in online_rows.items()
            ],
        )
        results["online"] = {"workload": wl.params(), "policies": online_rows}

    (out_dir / "engine_bench.json").write_text(json.dumps(results, indent=2))
    save_plot(results, out_dir / "engine_bench.png")
    print(f"wrote {out_dir / 'engine_bench.json'} and {out_dir / 'engine_bench.png'}")
    return 0


def _vocab(model_dir) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
