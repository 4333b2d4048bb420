"""`llm-fleet generate`: run prompts through the engine offline and print the completions."""

from __future__ import annotations

import time

from llmfleet.server.engine_flags import add_engine_flags, engine_flags

HELP = "generate text for prompts with the engine (no server); a quick demo of the built-in model"


def add_arguments(parser) -> None:
    parser.add_argument("prompts", nargs="*", default=["Hello, llm-fleet!", "The quick brown fox"])
    parser.add_argument("--model", default="builtin:tiny", help="builtin:tiny, builtin:small or a local HF model dir")
    parser.add_argument("--config", help="engine config YAML (knobs)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    add_engine_flags(parser)


def run(args) -> int:
    from llmfleet.server.config import load_engine_config
    from llmfleet.server.core.request import SamplingParams
    from llmfleet.server.core.validation import InvalidRequestError
    from llmfleet.server.engine.build import LOAD_ERRORS, build_engine

    try:
        config = load_engine_config(args.config, engine_flags(args))
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    except ValueError as exc:
        raise SystemExit(f"llm-fleet generate: {exc}") from exc
    try:
        engine, tokenizer = build_engine(args.model, config, device=args.device)
    except LOAD_ERRORS as exc:
        raise SystemExit(f"llm-fleet generate: cannot load {args.model}: {exc}") from exc
    if args.model.startswith("builtin:"):
        print(f"note: {args.model} has random weights; its text is gibberish by design.\n")
    prompts = [tokenizer.encode(p) for p in args.prompts]
    start = time.perf_counter()
    try:
        outputs = engine.generate(prompts, sampling)
    except InvalidRequestError as exc:
        raise SystemExit(f"llm-fleet generate: {exc}") from exc
    elapsed = time.perf_counter() - start
    for text, out in zip(args.prompts, outputs, strict=True):
        print(f"> {text}\n{tokenizer.decode(out, skip_special_tokens=True)!r}\n")
    tokens = sum(len(o) for o in outputs)
    print(
        f"{tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.0f} tok/s) "
        f"on {engine.runner.device}, {engine.runner.dtype}"
    )
    return 0
