"""Disaggregation's defining test at engine level: a prefill engine computes ``prompt[:-1]`` and
exports its KV; a decode engine imports it through the wire format and continues. In float32 the
decode engine's greedy output equals HF ``generate`` on the request alone, whatever the decode
engine's policy, its batch mix (imported and ordinary requests together), a preemption that
throws the imported KV away, or blocks left out of the transfer because the decode engine had them
cached (and perhaps evicted them before the request was admitted)."""

from __future__ import annotations

import random

import pytest
import torch

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.kv_wire import KVImport, decode, encode_body, leave_out_blocks
from llmfleet.server.core.request import SamplingParams
from llmfleet.server.engine.build import build_engine
from tests.server.runner.device import DEVICE
from tests.server.runner.test_engine_oracle import reference, reference_model  # noqa: F401 - the HF generate fixtures

DECODE_CASES = {
    "chunked-5": dict(policy="continuous", prefill_mode="chunked", max_num_batched_tokens=5),
    "merged": dict(policy="continuous", prefill_mode="merged", max_num_batched_tokens=64),
    "prefill-first": dict(policy="continuous", prefill_mode="prefill_first"),
    "static": dict(policy="static"),
    "preemption": dict(max_num_batched_tokens=16, num_kv_blocks=14),
}

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def prefill(engine, prompt: list[int], request_id: str, first_block: int = 0) -> bytes:
    """What a prefill server sends for ``prompt``: the wire body of ``prompt[:-1]``'s KV, from
    block ``first_block`` on."""
    engine.add_request(request_id, prompt[:-1], ONE_TOKEN, export_kv=True)
    exported = None
    while engine.has_unfinished_requests():
        for event in engine.step():
            if event.finished:
                exported = event.kv_export
    assert exported is not None
    layout = engine.runner.kv_layout
    sent = leave_out_blocks(exported, layout, len(prompt) - 1, first_block)
    return encode_body("m", layout, prompt[:-1], sent, first_block)


def run(engine, requests: dict[str, tuple]) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, (prompt, sampling, kv) in requests.items():
        engine.add_request(rid, prompt, sampling, kv_import=kv)
    while engine.has_unfinished_requests():
        engine.flush()  # static: launch partial batches
        for event in engine.step():
            outputs[event.request_id].extend(event.new_token_ids)
    return outputs


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decoding_imported_kv_matches_hf_generate(reference, case):  # noqa: F811
    name, prompts, max_tokens, _, expected = reference
    base = dict(dtype="float32", kv_block_size=4, max_batch_size=4)
    prefill_engine, _ = build_engine(
        name,
        EngineConfig(**base, kv_cache_memory_mb=4, prefill_mode="chunked", max_num_batched_tokens=7),
        device=DEVICE,
    )
    decode_engine, _ = build_engine(name, EngineConfig(**base, kv_cache_memory_mb=4, **DECODE_CASES[case]), DEVICE)
    requests = {}
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(max_tokens=max_tokens[i], temperature=0)
        kv = None
        if len(prompt) > 1 and i % 3 != 2:  # every third request is an ordinary one, in the same batches
            body = prefill(prefill_engine, prompt, f"p{i}")
            kv = KVImport(len(prompt) - 1, decode(body, "m", decode_engine.runner.kv_layout, prompt[:-1]))
        requests[str(i)] = (prompt, sampling, kv)
    outputs = run(decode_engine, requests)
    for i in range(len(prompts)):
        assert outputs[str(i)] == expected[i], f"request {i} diverged on {name} under {case}"
    if case == "preemption":
        assert decode_engine.stats().preemptions_total > 0
    assert decode_engine.block_manager.usage == 0 and prefill_engine.block_manager.usage == 0


def test_seeded_sampling_through_a_transfer_is_the_colocated_text():
    """The decode server samples every output token, the first included, with the request's own
    generator: a seed gives the colocated text."""
    config = EngineConfig(dtype="float32", kv_block_size=4, kv_cache_memory_mb=4)
    colocated, _ = build_engine("builtin:tiny", config, device=DEVICE)
    prefill_engine, _ = build_engine("builtin:tiny", config, device=DEVICE)
    decode_engine, _ = build_engine("builtin:tiny", config, device=DEVICE)
    rng = random.Random(3)
    prompt = [rng.randrange(5, 500) for _ in range(23)]
    sampling = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=11)
    want = colocated.generate([prompt], sampling)[0]
    body = prefill(prefill_engine, prompt, "p")
    kv = KVImport(len(prompt) - 1, decode(body, "m", decode_engine.runner.kv_layout, prompt[:-1]))
    assert run(decode_engine, {"d": (prompt, sampling, kv)})["d"] == want


def test_an_import_must_leave_the_last_prompt_token_to_compute():
    engine, _ = build_engine("builtin:tiny", EngineConfig(dtype="float32", kv_cache_memory_mb=4), device=DEVICE)
    whole = KVImport(3, memoryview(b""))
    with pytest.raises(ValueError, match="fewer than the 3 prompt tokens"):
        engine.add_request("x", [1, 2, 3], ONE_TOKEN, kv_import=whole)


LEFT_OUT_CASES = {"cached": 24, "evicted-before-admission": 24, "caching-turned-off": 24, "waiting-for-blocks": 12}


@pytest.mark.parametrize("case", list(LEFT_OUT_CASES))
def test_an_import_that_leaves_out_cached_blocks_gives_hf_generates_output(reference_model, case):  # noqa: F811
    """A decode engine that served a conversation's first turn has its blocks cached: the next
    turns, a prompt sharing its system prompt and the same prompt again are fetched without the
    blocks it holds (one of them with nothing left to send). Where those blocks are evicted between
    the fetch and admission (or prefix caching is turned off live), the import is dropped and the
    prompt computed here; where too few blocks are free for the rest, the request waits, its import
    kept."""
    name, model = reference_model
    rng = random.Random(5)
    system = [rng.randrange(5, 500) for _ in range(21)]
    first = system + [rng.randrange(5, 500) for _ in range(6)]
    other = [rng.randrange(5, 500) for _ in range(16)]  # an ordinary request that takes blocks first
    prompts = [[*system, 7, 8, 9], [*first, *range(40, 49)], [*first[:24], 3], other]  # 2: 24 cached tokens
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=DEVICE)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
        expected.append(out[0, len(prompt) :].tolist())
    base = dict(dtype="float32", kv_block_size=4, max_batch_size=4)
    prefill_engine, _ = build_engine(name, EngineConfig(**base, kv_cache_memory_mb=4), device=DEVICE)
    decode_config = EngineConfig(**base, num_kv_blocks=LEFT_OUT_CASES[case], max_num_batched_tokens=16)
    decode_engine, _ = build_engine(name, decode_config, DEVICE)
    sampling = SamplingParams(max_tokens=10, temperature=0)
    decode_engine.generate([first], sampling)  # the first turn, served here: its blocks stay cached
    layout = decode_engine.runner.kv_layout
    requests = {}
    if case == "waiting-for-blocks":
        requests["3"] = (other, sampling, None)
    for i, prompt in enumerate(prompts[:3]):
        cached = decode_engine.block_manager.cached_prefix_blocks(prompt[:-1])
        body = prefill(prefill_engine, prompt, f"p{i}", first_block=cached)
        requests[str(i)] = (
            prompt,
            sampling,
            KVImport(len(prompt) - 1, decode(body, "m", layout, prompt[:-1], cached), cached),
        )
    assert [requests[str(i)][2].first_block for i in range(3)] == [5, 6, 6]
    assert requests["2"][2].payload.nbytes == 0  # its 24 tokens are 6 full blocks, all cached
    if case == "evicted-before-admission":  # another prompt takes every block the cache held
        decode_engine.generate([[rng.randrange(5, 500) for _ in range(90)]], SamplingParams(max_tokens=2))
    if case == "caching-turned-off":
        decode_engine.update_config(decode_config.model_copy(update={"enable_prefix_caching": False}))
    outputs = run(decode_engine, requests)
    assert {rid: outputs[rid] for rid in requests} == {rid: expected[int(rid)] for rid in requests}
    stats = decode_engine.stats()
    if case == "cached":
        assert stats.kv_imports_recomputed == 0 and stats.prefix_cache_hits == 4 * (5 + 6 + 6)
    elif case == "evicted-before-admission":  # a later import may find its blocks cached again, by an earlier one
        assert stats.kv_imports_recomputed > 0
    elif case == "caching-turned-off":
        assert stats.kv_imports_recomputed == 3
    else:  # waiting, an import gives its shared blocks back, and they may be evicted before its turn
        assert stats.preemptions_total > 0
    assert decode_engine.block_manager.usage == 0
