"""`llm-fleet load`: send a workload at an OpenAI endpoint (the local fleet, a router, a Service)
and print what the clients see every few seconds, so the tuner's reactions show."""

from __future__ import annotations

from llmfleet.arguments import port, positive

HELP = "send a chat / long-prompt / creative workload at an OpenAI endpoint and report client latencies"

WORDS = ("fleet", "token", "batch", "queue", "prefill", "decode", "latency", "cache", "router", "replica", "window")


def add_arguments(parser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the OpenAI endpoint")
    parser.add_argument("--port", type=port, help="shorthand for --url http://127.0.0.1:PORT (as `up --port`)")
    parser.add_argument("--shape", default="chat", choices=["chat", "long-prompt", "creative"])
    parser.add_argument("--rate", type=positive, default=None, help="requests/s (default: the shape's)")
    parser.add_argument("--peak-rate", type=positive, help="ramp the rate linearly up to this by the end")
    parser.add_argument("--duration", type=positive, default=60.0, help="seconds of arrivals")
    parser.add_argument("--report-every", type=positive, default=5.0)
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    import asyncio
    import sys

    import httpx

    args.url = base_url(f"http://127.0.0.1:{args.port}" if args.port is not None else args.url)
    summary = Summary()
    try:
        asyncio.run(generate_load(args, summary))
    except LoadError as exc:
        print(f"error: {args.url}: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"error: {args.url}: {exc!r} (is `llm-fleet up` running?)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(summary.line("interrupted"))  # what the clients saw until Ctrl-C still counts
        raise  # `llm-fleet` ends it as every command's Ctrl-C
    print(summary.line("total"))
    for kind, count in summary.failures.most_common():  # what failed, in the servers' words
        print(f"  {count} x {kind}, e.g. {summary.example[kind]}")
    return 0 if summary.errors == 0 else 1


class Failed(Exception):
    """One request failed: its kind (HTTP 400, an error event) and the server's message."""


class LoadError(Exception):
    """The endpoint cannot take the workload (no model list, a key it wants): one line, exit 2."""


def base_url(url: str) -> str:
    """The endpoint's root: also as an OpenAI client's base_url is written, ending in /v1."""
    return url.rstrip("/").removesuffix("/v1")


async def served_model(client) -> str:
    """The first model id in the endpoint's /v1/models, or a LoadError that says why there is none."""
    import os

    from llmfleet.server.wire.auth import API_KEY_ENV

    response = await client.get("/v1/models")
    if response.status_code == 401:
        fix = f"{API_KEY_ENV} is not its key" if os.environ.get(API_KEY_ENV) else f"set {API_KEY_ENV} to its key"
        raise LoadError(f"/v1/models: 401 Unauthorized: the server requires an API key; {fix}")
    if response.is_error:
        raise LoadError(f"/v1/models: {response.status_code} {response.reason_phrase}")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, LookupError, TypeError):
        raise LoadError("/v1/models did not answer with a list of models: is this an OpenAI endpoint?") from None


async def prompt_sizing(client, model: str) -> tuple[float, int | None]:
    """Tokens per word of the served model's tokenizer and its context limit, from /tokenize (as
    vLLM answers it); an endpoint without it: about 1.5 tokens a word, no limit known."""
    sample = WORDS * 8
    try:
        response = await client.post("/tokenize", json={"model": model, "prompt": " ".join(sample)})
        answer = response.json()
        return answer["count"] / len(sample), answer.get("max_model_len")
    except (ValueError, LookupError, TypeError, ZeroDivisionError):
        return 1.5, None


def prompt_tokens(wanted: int, max_tokens: int, limit: int | None) -> int:
    """The shape's prompt length, cut so prompt and answer fit the model's context (with room for
    the words-to-tokens estimate): else every long prompt is a 400 on a small model."""
    if limit is None:
        return wanted
    return max(1, min(wanted, int((limit - max_tokens) * 0.9)))


class Summary:
    def __init__(self) -> None:
        import collections

        self.sent = self.done = self.errors = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.failures: collections.Counter[str] = collections.Counter()  # by kind: HTTP 400, ReadTimeout, ...
        self.example: dict[str, str] = {}  # the first message of each kind

    def failed(self, kind: str, message: str) -> None:
        self.failures[kind] += 1
        self.example.setdefault(kind, message)

    def line(self, label: str) -> str:
        def p(values: list[float], q: float) -> str:
            if not values:
                return "-"
            ordered = sorted(values)
            return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:.0f}"

        ttft = f"{p(self.ttft, 0.5)}/{p(self.ttft, 0.95)}"
        itl = f"{p(self.itl, 0.5)}/{p(self.itl, 0.95)}"
        counts = f"sent {self.sent}, done {self.done}, errors {self.errors}"
        return f"{label}: {counts}; TTFT p50/p95 {ttft} ms; ITL p50/p95 {itl} ms"


async def generate_load(args, total: Summary) -> None:
    """Send the workload, counting into ``total`` as it goes (so an interrupted run still has it)."""
    import asyncio
    import json
    import os
    import random
    import time

    import httpx

    from llmfleet.server.wire.sse import event_lines
    from llmfleet.workloads import SHAPES

    shape = SHAPES[args.shape]
    rng = random.Random(args.seed)
    start_rate = args.rate or shape.rate_per_s or 1.0
    peak = args.peak_rate or start_rate
    window = Summary()
    from llmfleet.server.wire.auth import API_KEY_ENV, bearer

    key = bearer(os.environ.get(API_KEY_ENV))  # a fleet that requires a key (vLLM's --api-key)
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(300.0, connect=5.0), headers=key) as client:
        model = await served_model(client)
        tokens_per_word, limit = await prompt_sizing(client, model)
        if limit is not None and shape.prompt_len[1] + shape.output_len[1] > limit:
            print(f"note: prompts are cut to fit the model's context ({limit} tokens)", flush=True)

        async def one(prompt_words: int, max_tokens: int) -> None:
            for s in (total, window):
                s.sent += 1
            body = {
                "model": model,
                "prompt": " ".join(rng.choice(WORDS) for _ in range(prompt_words)),
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0,
            }
            began = last = time.monotonic()
            first = True
            try:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.is_error:
                        await response.aread()
                        raise Failed(f"HTTP {response.status_code}", _error_message(response.text))
                    async for line in event_lines(response.aiter_text()):
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        if "error" in json.loads(line[6:]):
                            raise Failed("error event", _error_message(line[6:]))
                        now = time.monotonic()
                        for s in (total, window):
                            (s.ttft if first else s.itl).append(now - (began if first else last))
                        first, last = False, now
                for s in (total, window):
                    s.done += 1
            except (Failed, httpx.HTTPError) as exc:
                kind, message = exc.args if isinstance(exc, Failed) else (type(exc).__name__, str(exc) or repr(exc))
                total.failed(kind, message)
                for s in (total, window):
                    s.errors += 1

        tasks = []
        began = time.monotonic()
        next_report = began + args.report_every
        t = 0.0
        while t < args.duration:
            rate = start_rate + (peak - start_rate) * t / args.duration
            t += rng.expovariate(rate)
            while time.monotonic() - began < t:
                if time.monotonic() >= next_report:
                    print(window.line(f"t={time.monotonic() - began:4.0f}s rate {rate:.1f}/s"), flush=True)
                    window.__init__()
                    next_report += args.report_every
                await asyncio.sleep(min(0.05, max(0.0, t - (time.monotonic() - began))))
            wanted, max_tokens = rng.randint(*shape.prompt_len), rng.randint(*shape.output_len)
            words = round(prompt_tokens(wanted, max_tokens, limit) / tokens_per_word)
            tasks.append(asyncio.create_task(one(max(1, words), max_tokens)))
        await asyncio.gather(*tasks)


def _error_message(text: str) -> str:
    """An OpenAI error body's message, else the text itself (cut short)."""
    import json

    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, LookupError, TypeError):
        return text[:200]
