"""Router policies side by side on multi-turn conversations: ``load`` vs ``prefix``.

One disaggregated fleet per contender, the same for both: a router, two prefill and two decode
servers (one torch thread each). The workload is conversations that go on: each one opens with a
prompt of its own (behind a system prompt they all share, with ``--system-tokens``), and each
next turn sends the whole conversation so far plus a new message, a short think time after the
last answer (closed loop per conversation). Every turn's prompt begins with the one before, so
the server that took the previous turn holds most of its KV in its prefix cache; whether the next
turn lands there is the router policy's doing.

Reported per contender: TTFT and end-to-end p50/p99 as the clients see them, the prefill
servers' prefix cache hit rate (``vllm:prefix_cache_hits`` / ``_queries``), and the KV the decode
servers fetched, and left out because they had it cached. Ratios are prefix / load.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from llmfleet.arguments import non_negative_int, positive_int
from llmfleet.bench.disagg_bench import Servers
from llmfleet.bench.report import latency_summary, print_table
from llmfleet.bench.server_bench import stream_completion

POLICIES = ("load", "prefix")
PREFILL_SERVERS = DECODE_SERVERS = 2


@dataclass(frozen=True)
class Conversations:
    count: int = 8
    turns: int = 4
    system_tokens: int = 0  # a system prompt every conversation opens with
    opening_tokens: int = 320  # each conversation's own first prompt
    turn_tokens: int = 64  # the answer and the next message each turn adds
    output_tokens: int = 24
    think_s: float = 0.5
    stagger_s: float = 0.4  # between conversation starts

    def prompts(self, vocab: int, seed: int = 7) -> list[list[list[int]]]:
        """Per conversation, the prompt of each turn (each one extends the one before)."""
        rng = random.Random(seed)
        system = [rng.randrange(5, vocab) for _ in range(self.system_tokens)]
        out = []
        for _ in range(self.count):
            prompt = system + [rng.randrange(5, vocab) for _ in range(self.opening_tokens)]
            turns = [list(prompt)]
            for _ in range(self.turns - 1):
                prompt += [rng.randrange(5, vocab) for _ in range(self.turn_tokens)]
                turns.append(list(prompt))
            out.append(turns)
        return out


def add_arguments(parser) -> None:
    group = parser.add_argument_group("router bench")
    group.add_argument("--conversations", type=positive_int, default=Conversations.count, help="router: conversations")
    group.add_argument("--turns", type=positive_int, default=Conversations.turns, help="router: turns per conversation")
    group.add_argument(
        "--system-tokens",
        type=non_negative_int,
        default=Conversations.system_tokens,
        help="router: a system prompt of this many tokens that every conversation opens with",
    )


async def _converse(http, url: str, turns: list[list[int]], n: int, start: float, delay: float, think: float):
    await asyncio.sleep(delay)
    traces = []
    for prompt in turns:
        traces.append(await stream_completion(http, url, prompt, n, start, time.monotonic() - start))
        await asyncio.sleep(think)
    return traces


async def replay(url: str, workload: Conversations, conversations: list[list[list[int]]]) -> dict:
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=workload.count + 4)) as http:
        start = time.monotonic()
        runs = await asyncio.gather(
            *(
                _converse(http, url, turns, workload.output_tokens, start, i * workload.stagger_s, workload.think_s)
                for i, turns in enumerate(conversations)
            )
        )
        total = time.monotonic() - start
    return latency_summary([t for run in runs for t in run], total)


def scrape(urls: list[str], names: tuple[str, ...]) -> dict[str, float]:
    """Each metric summed over ``urls`` (every label set)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(names, 0.0)
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
    return totals


SERVER_METRICS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "llmfleet_kv_transfer_bytes_sum",
    "llmfleet_kv_transfer_cached_tokens_total",
)


def run(args) -> int:
    from llmfleet.server.config import EngineConfig
    from llmfleet.server.runner.builtin_models import resolve_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(resolve_model(args.model))  # built once here, not by five servers at once
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    workload = Conversations(count=args.conversations, turns=args.turns, system_tokens=args.system_tokens)
    conversations = workload.prompts(vocab)
    config = EngineConfig(dtype=args.dtype, max_batch_size=32, max_num_batched_tokens=512, kv_cache_memory_mb=512)
    config_file = out / "router_bench_engine.yaml"
    config_file.write_text(config.to_yaml())
    engine_args = ("--model", args.model, "--config", str(config_file), "--served-model-name", "bench")
    print(
        f"== router policies on conversations: {workload.count} conversations x {workload.turns} turns, "
        f"{workload.system_tokens} tokens of a shared system prompt, "
        f"{workload.opening_tokens}-token openings, +{workload.turn_tokens} tokens a turn, "
        f"{workload.output_tokens} out; {PREFILL_SERVERS} prefill + {DECODE_SERVERS} decode servers "
        f"(1 thread each), {args.model}, {config.dtype}"
    )
    results: dict = {"model": args.model, "workload": asdict(workload), "engine": config.model_dump(mode="json")}
    for policy in POLICIES:
        with Servers(out) as servers:
            prefill = [servers.start(f"prefill{i}", 1, "--role", "prefill", *engine_args) for i in range(2)]
            pool = [a for url in prefill for a in ("--prefill-url", url)]  # the only ones decode fetches from
            decode = [servers.start(f"decode{i}", 1, "--role", "decode", *pool, *engine_args) for i in range(2)]
            urls = [a for url in prefill for a in ("--prefill-url", url)] + [
                a for url in decode for a in ("--decode-url", url)
            ]
            router = servers.start(
                "router", None, "--role", "router", "--served-model-name", "bench", "--router-policy", policy, *urls
            )
            servers.wait_ready()
            summary = asyncio.run(replay(router, workload, conversations))
            prefill_m, decode_m = scrape(prefill, SERVER_METRICS), scrape(decode, SERVER_METRICS)
        queried = prefill_m["vllm:prefix_cache_queries_total"]
        summary |= {
            "prefill_hit_rate": prefill_m["vllm:prefix_cache_hits_total"] / queried if queried else 0.0,
            "kv_fetched_bytes": decode_m["llmfleet_kv_transfer_bytes_sum"],
            "kv_cached_tokens": decode_m["llmfleet_kv_transfer_cached_tokens_total"],
        }
        results[policy] = summary
    rows = [_row(policy, results[policy], results["load"]) for policy in POLICIES]
    print_table(["policy", "TTFT p50/p99", "e2e p50/p99", "prefill cache hits", "KV fetched", "KV tokens cached"], rows)
    (out / "router_bench.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'router_bench.json'}")
    return 0


def _row(policy: str, r: dict, base: dict) -> list[str]:
    return [
        policy,
        f"{r['ttft_p50']:.2f}/{r['ttft_p99']:.2f}s ({r['ttft_p50'] / base['ttft_p50']:.2f}x p50)",
        f"{r['e2e_p50']:.2f}/{r['e2e_p99']:.2f}s ({r['e2e_p50'] / base['e2e_p50']:.2f}x p50)",
        f"{r['prefill_hit_rate']:.0%}",
        f"{r['kv_fetched_bytes'] / 1e6:.1f} MB ({r['kv_fetched_bytes'] / max(base['kv_fetched_bytes'], 1):.2f}x)",
        f"{r['kv_cached_tokens']:.0f}",
    ]
