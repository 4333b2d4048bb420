"""The engine's defining test, through LLMEngine + TorchModelRunner: in float32, greedy output of
every request equals HF ``generate`` on that request alone, token for token, whatever the
policy, prefill mode, chunk size, batch mix, priority order, preemption or arrival pattern.

(tests/server/runner/test_runner_oracle.py checks the same at runner level with hand-built steps.)"""

from __future__ import annotations

import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.request import SamplingParams
from llmfleet.server.core.validation import InvalidRequestError
from llmfleet.server.engine.build import build_engine
from llmfleet.server.runner.builtin_models import resolve_model
from llmfleet.server.runner.step_shapes import warm_up_sizes
from tests.server.runner.device import DEVICE

MODELS = ["builtin:tiny", "builtin:tiny-qwen2", "builtin:tiny-mistral"]

CASES = {
    "continuous-chunked-7": dict(policy="continuous", prefill_mode="chunked", max_num_batched_tokens=7),
    "continuous-chunked-3": dict(policy="continuous", prefill_mode="chunked", max_num_batched_tokens=3),
    "continuous-chunked-1": dict(policy="continuous", prefill_mode="chunked", max_num_batched_tokens=1),
    "continuous-merged": dict(policy="continuous", prefill_mode="merged", max_num_batched_tokens=64),
    "continuous-prefill-first": dict(policy="continuous", prefill_mode="prefill_first"),
    "static": dict(policy="static"),
    "dynamic": dict(policy="dynamic", batch_timeout_ms=1.0),
    "priority": dict(scheduling="priority", priority_work_weight=10.0, max_num_batched_tokens=16),
    "preemption": dict(max_num_batched_tokens=16, num_kv_blocks=14),
    "preemption-merged-priority": dict(prefill_mode="merged", scheduling="priority", num_kv_blocks=14),
    "interval-ratio": dict(schedule_interval=2, waiting_served_ratio=0.5, max_waiting_steps=3),
}


def workload(seed: int = 7):
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    priorities = [rng.randint(0, 3) for _ in prompts]
    return prompts, max_tokens, priorities


def hf_greedy(name: str, prompts: list[list[int]], max_tokens: list[int], device: str = DEVICE) -> list[list[int]]:
    """HF ``generate``'s greedy output for each prompt alone, in float32: the oracle."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=torch.float32).to(device)
    expected = []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
        expected.append(out[0, len(prompt) :].tolist())
    return expected


@pytest.fixture(scope="module", params=MODELS)
def reference(request):
    """(model name, prompts, max_tokens, priorities, HF generate outputs one request at a time)."""
    prompts, max_tokens, priorities = workload()
    return request.param, prompts, max_tokens, priorities, hf_greedy(request.param, prompts, max_tokens)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf_generate(reference, case):
    name, prompts, max_tokens, priorities, expected = reference
    config = EngineConfig(dtype="float32", kv_block_size=4, max_batch_size=4, kv_cache_memory_mb=4, **CASES[case])
    engine, _ = build_engine(name, config, device=DEVICE)
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    # half the requests arrive mid-run, while the first half is decoding
    for step in range(10_000):
        if step in (0, 3):
            half = range(0, 4) if step == 0 else range(4, 8)
            for i in half:
                engine.add_request(
                    str(i),
                    prompts[i],
                    SamplingParams(max_tokens=max_tokens[i], temperature=0),
                    priority=priorities[i],
                )
        if step > 3 and not engine.has_unfinished_requests():
            break
        if step > 3:
            engine.flush()  # static: launch partial batches
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.finished:
                finished.add(event.request_id)
    assert finished == {str(i) for i in range(8)}
    for i in range(8):
        assert outputs[str(i)] == expected[i], f"request {i} diverged under {case} on {name}"
    if case.startswith("preemption"):
        assert engine.stats().preemptions_total > 0
    assert engine.block_manager.usage == 0


def test_seed_gives_the_same_text_whatever_the_batch():
    engine, _ = build_engine("builtin:tiny", EngineConfig(dtype="float32", kv_cache_memory_mb=4), device=DEVICE)
    sampling = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=42)
    alone = engine.generate([[10, 11, 12]], sampling)[0]
    crowd = engine.generate(
        [[1, 2], [10, 11, 12], [7] * 9], [SamplingParams(max_tokens=10, temperature=1.0), sampling, sampling]
    )
    assert crowd[1] == alone
    other = engine.generate([[10, 11, 12]], SamplingParams(max_tokens=16, temperature=1.0, seed=43))[0]
    assert other != alone


def test_token_ids_the_model_does_not_embed_are_rejected_before_a_step():
    engine, _ = build_engine("builtin:tiny", EngineConfig(dtype="float32", kv_cache_memory_mb=4), device=DEVICE)
    vocab = engine.runner.model.get_input_embeddings().num_embeddings
    with pytest.raises(InvalidRequestError, match=re.escape(f"must be in [0, {vocab}), got {vocab}")):
        engine.add_request("oov", [3, vocab], SamplingParams(max_tokens=2, temperature=0))
    assert engine.generate([[3, vocab - 1]], SamplingParams(max_tokens=2, temperature=0))[0]


def test_top_k_one_is_greedy_and_logprobs_are_returned():
    engine, _ = build_engine("builtin:tiny", EngineConfig(dtype="float32", kv_cache_memory_mb=4), device=DEVICE)
    greedy = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=8, temperature=0))[0]
    top1 = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=8, temperature=0.8, top_k=1))[0]
    assert top1 == greedy
    engine.add_request("lp", [3, 4, 5], SamplingParams(max_tokens=3, temperature=0, logprobs=2))
    events = []
    while engine.has_unfinished_requests():
        events += engine.step()
    for event in events:
        (token,) = event.logprobs
        assert token.logprob <= 0 and len(token.top_logprobs) == 2
        assert token.token_id in token.top_logprobs  # greedy token is the top one


def test_bfloat16_mostly_agrees_with_float32():
    """bf16 rounding flips near-tied argmaxes now and then, so only most tokens must agree."""
    prompts, _, _ = workload()
    sampling = SamplingParams(max_tokens=16, temperature=0)
    outputs = {}
    for dtype in ("float32", "bfloat16"):
        engine, _ = build_engine("builtin:tiny", EngineConfig(dtype=dtype, kv_cache_memory_mb=4), device=DEVICE)
        assert engine.runner.dtype == getattr(torch, dtype)
        # a padded runner (any dtype on a CPU: oneDNN's linears) ran its step sizes before serving (warm_up.py)
        warmed = DEVICE == "cpu"
        assert engine.runner.warm_sizes == (frozenset(warm_up_sizes(512)) if warmed else frozenset())
        outputs[dtype] = engine.generate(prompts, sampling)
    assert all(len(o) == 16 for o in outputs["bfloat16"])
    # tokens agreeing before each request's first divergence
    agreeing = [
        next((i for i, (a, b) in enumerate(zip(full, half, strict=True)) if a != b), 16)
        for full, half in zip(outputs["float32"], outputs["bfloat16"], strict=True)
    ]
    assert sum(agreeing) >= 0.5 * 16 * len(prompts), agreeing


PROCESSING_CASES = {k: CASES[k] for k in ("continuous-chunked-3", "preemption-merged-priority")}


@pytest.fixture(scope="module")
def processing_reference():
    """Requests with logits processing, each with its HF ``generate`` output alone: the
    repetition penalty is HF's own, a logit bias is HF's single-token ``sequence_bias``, and
    min_tokens with a stop token is ``min_new_tokens`` with that token as EOS."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny"), dtype=torch.float32).to(DEVICE)
    prompts, _, _ = workload(seed=11)

    def hf(prompt: list[int], **kwargs) -> list[int]:
        ids = torch.tensor([prompt], device=DEVICE)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kwargs)
        return out[0, len(prompt) :].tolist()

    stop = hf(prompts[2], max_new_tokens=2)[1]  # greedy's second token: it would stop at once
    bias = {hf(prompts[1], max_new_tokens=1)[0] + 1: 4.0}
    sequence_bias = {(t,): b for t, b in bias.items()}
    cases = [
        (SamplingParams(max_tokens=14, temperature=0, repetition_penalty=1.3), dict(repetition_penalty=1.3)),
        (SamplingParams(max_tokens=10, temperature=0, logit_bias=bias), dict(sequence_bias=sequence_bias)),
        (
            SamplingParams(max_tokens=12, temperature=0, min_tokens=6, stop_token_ids=[stop], ignore_eos=True),
            dict(min_new_tokens=6, eos_token_id=stop),
        ),
        (SamplingParams(max_tokens=9, temperature=0), {}),
        (
            SamplingParams(max_tokens=16, temperature=0, repetition_penalty=0.8, logit_bias=bias),
            dict(repetition_penalty=0.8, sequence_bias=sequence_bias),
        ),
    ]
    expected = [hf(prompts[i], max_new_tokens=s.max_tokens, **kw) for i, (s, kw) in enumerate(cases)]
    return prompts, [s for s, _ in cases], expected


@pytest.mark.parametrize("case", list(PROCESSING_CASES))
def test_logits_processing_matches_hf_generate(processing_reference, case):
    prompts, samplings, expected = processing_reference
    config = EngineConfig(dtype="float32", kv_block_size=4, max_batch_size=4, kv_cache_memory_mb=4, **CASES[case])
    engine, _ = build_engine("builtin:tiny", config, device=DEVICE)
    outputs = engine.generate(prompts[: len(samplings)], samplings)
    assert outputs == expected
    assert len(expected[2]) >= 6  # without min_tokens it stops at its second token
    if case.startswith("preemption"):
        assert engine.stats().preemptions_total > 0  # recomputed requests keep their penalties' history


@pytest.fixture(scope="module", params=MODELS)
def prompt_scores(request):
    """The workload's prompts, each one's log-softmax at every position from one HF forward pass
    over the prompt alone, and its greedy continuation."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model(request.param), dtype=torch.float32).to(DEVICE)
    prompts, _, _ = workload(seed=13)
    scores, greedy = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=DEVICE)
        with torch.no_grad():
            scores.append(torch.log_softmax(model(ids).logits[0].float(), dim=-1).cpu())
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
        greedy.append(out[0, len(prompt) :].tolist())
    return request.param, prompts, scores, greedy


@pytest.mark.parametrize("case", ["continuous-chunked-3", "continuous-merged", "preemption-merged-priority"])
def test_prompt_logprobs_are_hf_forward_log_softmax(prompt_scores, case):
    """vLLM's prompt logprobs: for prompt tokens 1.., the model's raw logprob of each from the
    position before it, and the top-N there; the same under chunking and preemption (recomputed
    positions are not recorded twice), beside requests that do not ask."""
    name, prompts, scores, greedy = prompt_scores
    config = EngineConfig(dtype="float32", kv_block_size=4, max_batch_size=4, kv_cache_memory_mb=4, **CASES[case])
    engine, _ = build_engine(name, config, device=DEVICE)
    asks = [2 if i % 3 != 2 else None for i in range(len(prompts))]  # 0, 2 and None mixed
    asks[0] = 0
    for i, (prompt, n) in enumerate(zip(prompts, asks, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=n))
    tokens: dict[str, list[int]] = {}
    got: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.prompt_logprobs is not None:
                assert event.request_id not in got, "prompt logprobs come once, with the first token"
                got[event.request_id] = event.prompt_logprobs
    assert [tokens[str(i)] for i in range(len(prompts))] == greedy
    assert set(got) == {str(i) for i, n in enumerate(asks) if n is not None}
    for key, entries in got.items():
        i = int(key)
        prompt, lp = prompts[i], scores[i]
        assert [e.token_id for e in entries] == prompt[1:]
        want = [lp[k, prompt[k + 1]].item() for k in range(len(prompt) - 1)]
        assert [e.logprob for e in entries] == pytest.approx(want, abs=1e-4)
        for k, entry in enumerate(entries):
            assert entry.rank == int((lp[k] > lp[k, prompt[k + 1]]).sum()) + 1
            if asks[i] == 0:
                assert entry.top_logprobs is None
            else:
                top = lp[k].topk(asks[i])
                assert list(entry.top_logprobs) == top.indices.tolist()
                assert list(entry.top_logprobs.values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    if case.startswith("preemption"):
        assert engine.stats().preemptions_total > 0


PREFIX_CASES = {
    "chunked-5": dict(max_num_batched_tokens=5),
    "merged": dict(prefill_mode="merged", max_num_batched_tokens=64),
    "preemption": dict(max_num_batched_tokens=16, num_kv_blocks=14),
    "sha256": dict(max_num_batched_tokens=16, prefix_caching_hash_algo="sha256"),
}


@pytest.mark.parametrize("case", list(PREFIX_CASES))
def test_prefix_cache_hits_give_hf_generates_output(reference_model, case):
    """Requests sharing a long prefix (a system prompt; a conversation that goes on; the same
    prompt again) reuse its cached KV blocks, and each output is still HF generate's alone."""
    name, model = reference_model
    rng = random.Random(11)
    system = [rng.randrange(5, 500) for _ in range(21)]
    first = system + [rng.randrange(5, 500) for _ in range(6)]
    prompts = [first, [*system, 7, 8, 9], [*first, *range(40, 49)], list(first), system[:13]]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=DEVICE)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
        expected.append(out[0, len(prompt) :].tolist())
    config = EngineConfig(
        dtype="float32", kv_block_size=4, max_batch_size=4, kv_cache_memory_mb=4, **PREFIX_CASES[case]
    )
    engine, _ = build_engine(name, config, device=DEVICE)
    sampling = SamplingParams(max_tokens=10, temperature=0)
    # the first request alone, then the rest while it is cached (and, with preemption, evicted in part)
    outputs = engine.generate(prompts[:1], sampling) + engine.generate(prompts[1:], sampling)
    assert outputs == expected, f"prefix-cached output diverged under {case} on {name}"
    stats = engine.stats()
    if case == "preemption":  # a preempted request finds its own blocks again, where not evicted
        assert stats.preemptions_total > 0 and stats.prefix_cache_hits > 0, stats
    else:  # the whole blocks before each later request's last token: 5, 6, 6 and 3 blocks of 4
        assert stats.prefix_cache_hits == 4 * (5 + 6 + 6 + 3), stats
    assert engine.block_manager.usage == 0
    off = EngineConfig(**{**config.model_dump(), "enable_prefix_caching": False})
    engine, _ = build_engine(name, off, device=DEVICE)
    assert engine.generate(prompts, sampling) == expected and engine.stats().prefix_cache_hits == 0


@pytest.fixture(scope="module", params=MODELS)
def reference_model(request):
    model = AutoModelForCausalLM.from_pretrained(resolve_model(request.param), dtype=torch.float32).to(DEVICE)
    return request.param, model
