"""The engine loop and each policy's behaviour, on a fake runner and a fake clock."""

from __future__ import annotations

import re

import pytest

from llmfleet.server.config import EngineConfig, load_engine_config
from llmfleet.server.core.request import SamplingParams
from llmfleet.server.core.validation import InvalidRequestError
from llmfleet.server.engine.engine import LLMEngine, QueueFullError, StepFailedError
from tests.server.core.fakes import FakeClock, FakeRunner, reference_output


class LetterDecoder:
    """Token t decodes to one letter; token 999 to half of a two-byte character."""

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(chr(ord("a") + t % 26) for t in ids if t != 999)
        return text + ("\ufffd" if ids and ids[-1] == 999 else "")


def make(clock=None, decoder=None, **knobs):
    clock = clock or FakeClock()
    runner = FakeRunner(num_kv_blocks=knobs.pop("num_blocks", 64), kv_block_size=4, max_model_len=64)
    return LLMEngine(EngineConfig(**knobs), runner, clock=clock, detokenizer=decoder), runner, clock


def run_all(engine, clock, dt=0.001, limit=2000):
    events = []
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return events
        events += engine.step()
        clock.advance(dt)
    raise AssertionError("engine made no progress")


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0)


# --- bad input -----------------------------------------------------------------------------------
def test_bad_input_is_a_clear_error():
    engine, _, _ = make()
    with pytest.raises(InvalidRequestError, match="at least one token"):
        engine.add_request("a", [], greedy(4))
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        engine.add_request("b", list(range(60)), greedy(8))
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    engine.add_request("c", [1], greedy(1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("c", [1], greedy(1))
    tiny, _, _ = make(num_blocks=2)
    with pytest.raises(InvalidRequestError, match="KV cache blocks"):
        tiny.add_request("d", list(range(10)), greedy(4))


def test_unknown_policy_or_knob_value_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="policy"):
        EngineConfig(policy="fastest")
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineConfig(max_batch_size=0)
    bad = tmp_path / "engine.yaml"
    bad.write_text("policy: continuous\nmax_num_batched_tokens: -3\nnot_a_knob: 1\n")
    with pytest.raises(ValueError, match=r"max_num_batched_tokens.*not_a_knob|not_a_knob.*max_num"):
        load_engine_config(bad)


def test_vllms_dtype_spellings_are_taken(tmp_path):
    assert (EngineConfig(dtype="half").dtype, EngineConfig(dtype="float").dtype) == ("float16", "float32")
    config = tmp_path / "engine.yaml"
    config.write_text("dtype: half\n")
    assert load_engine_config(config).dtype == "float16"
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="fp8")


def test_queue_full():
    engine, _, _ = make(max_queue_len=2)
    engine.add_request("a", [1], greedy(1))
    engine.add_request("b", [1], greedy(1))
    with pytest.raises(QueueFullError):
        engine.add_request("c", [1], greedy(1))


# --- lifecycle -------------------------------------------------------------------------------------
def test_abort_frees_blocks_at_once_and_reports():
    engine, runner, _clock = make()
    engine.add_request("a", list(range(10)), greedy(20))
    engine.step()
    assert engine.block_manager.usage > 0
    assert engine.abort_request("a")
    assert engine.block_manager.usage == 0
    events = engine.step()
    assert [(e.request_id, e.finished, e.finish_reason) for e in events] == [("a", True, "abort")]
    assert "a" in runner.released
    assert not engine.abort_request("a")


def test_stop_strings_are_cut_and_partial_matches_held_back():
    # tokens decode to letters; find a prompt whose reference output contains a known substring
    prompt = [5, 6, 7]
    text = "".join(chr(ord("a") + t % 26) for t in reference_output(prompt, 12))
    stop = text[4:6]
    engine, _, clock = make(decoder=LetterDecoder())
    engine.add_request("a", prompt, SamplingParams(max_tokens=12, temperature=0, stop=[stop]))
    events = run_all(engine, clock)
    streamed = "".join(e.new_text for e in events)
    assert streamed == text[: text.index(stop)]
    assert events[-1].finish_reason == "stop"


def test_a_stop_string_in_the_last_tokens_held_back_text_is_a_stop_not_length():
    """The last token allowed ends mid-character: its text is released as U+FFFD at the end, and
    a stop string there cuts it and is why the request ended, as in vLLM."""
    prompt = [5, 6, 7]
    ref = reference_output(prompt, 6)

    class HalfLast(LetterDecoder):
        def decode(self, ids, skip_special_tokens=True):
            return super().decode([999 if t == ref[-1] else t for t in ids], skip_special_tokens)

    engine, _, clock = make(decoder=HalfLast())
    engine.add_request("a", prompt, SamplingParams(max_tokens=6, temperature=0, stop=["\ufffd"]))
    events = run_all(engine, clock)
    assert "\ufffd" not in "".join(e.new_text for e in events)
    assert (events[-1].finish_reason, events[-1].stop_reason) == ("stop", "\ufffd")


def test_a_stop_tokens_text_is_kept_when_asked_for():
    prompt = [5, 6, 7]
    ref = reference_output(prompt, 10)
    letters = "".join(chr(ord("a") + t % 26) for t in ref)
    for include, want in ((False, letters[:3]), (True, letters[:4])):
        engine, _, clock = make(decoder=LetterDecoder())
        sampling = SamplingParams(
            max_tokens=10, temperature=0, stop_token_ids=[ref[3]], include_stop_str_in_output=include
        )
        engine.add_request("a", prompt, sampling)
        events = run_all(engine, clock)
        assert "".join(e.new_text for e in events) == want and events[-1].finish_reason == "stop"


class WordDecoder:
    """Sentencepiece-like: each token a word after a space, the text's first space stripped."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" w{t}" for t in ids).removeprefix(" ")


def test_the_answers_first_word_keeps_its_space_after_the_prompt():
    engine, _, clock = make(decoder=WordDecoder())
    engine.add_request("a", [1, 2], greedy(2))
    text = "".join(e.new_text for e in run_all(engine, clock))
    assert text == "".join(f" w{t}" for t in reference_output([1, 2], 2))


def test_stop_token_and_eos():
    prompt = [5, 6, 7]
    ref = reference_output(prompt, 10)
    engine, _, clock = make()
    engine.add_request("a", prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[ref[3]]))
    events = run_all(engine, clock)
    assert [t for e in events for t in e.new_token_ids] == ref[:4]
    assert events[-1].finish_reason == "stop"

    engine, runner, clock = make()
    runner.eos_token_ids = frozenset({ref[2]})
    engine.add_request("b", prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    engine.add_request("c", prompt, SamplingParams(max_tokens=10))
    by_id = {}
    for e in run_all(engine, clock):
        by_id.setdefault(e.request_id, []).extend(e.new_token_ids)
    assert by_id["b"] == ref and by_id["c"] == ref[:3]


# --- policies ------------------------------------------------------------------------------------
def admitted_per_step(runner):
    return [[rid for rid, start, _ in batch if start == 0] for batch in runner.batches]


def test_static_waits_for_a_full_batch_then_runs_it_to_completion():
    engine, runner, clock = make(policy="static", max_batch_size=3)
    engine.add_request("a", [1, 2], greedy(2))
    engine.add_request("b", [1, 2], greedy(6))
    assert engine.step() == [] and not runner.batches  # 2 < 3: hold
    engine.add_request("c", [3], greedy(2))
    engine.step()
    engine.add_request("d", [4], greedy(2))
    for _ in range(8):  # b needs 6 steps; d must not join while it runs
        engine.step()
    assert admitted_per_step(runner)[0] == ["a", "b", "c"]
    assert all("d" not in step for step in admitted_per_step(runner))
    engine.flush()
    run_all(engine, clock)
    assert ["d"] in admitted_per_step(runner)


def test_static_batch_fills_at_the_queue_cap_when_that_is_smaller():
    # A waiting queue capped below max_batch_size could never form a full batch.
    engine, runner, clock = make(policy="static", max_batch_size=8, max_queue_len=2)
    engine.add_request("a", [1, 2], greedy(2))
    engine.add_request("b", [3], greedy(2))
    with pytest.raises(QueueFullError):
        engine.add_request("c", [4], greedy(2))
    events = run_all(engine, clock)
    assert admitted_per_step(runner)[0] == ["a", "b"]
    assert sorted(e.request_id for e in events if e.finished) == ["a", "b"]


def test_dynamic_launches_a_partial_batch_after_the_window():
    engine, runner, clock = make(policy="dynamic", max_batch_size=4, batch_timeout_ms=10)
    engine.add_request("a", [1], greedy(1))
    clock.advance(0.004)
    engine.add_request("b", [1], greedy(1))
    assert engine.next_wakeup() == pytest.approx(0.010)
    clock.advance(0.005)
    assert engine.step() == []  # oldest waited 9 ms
    clock.advance(0.001)
    engine.step()  # 10 ms: launch
    assert admitted_per_step(runner)[0] == ["a", "b"]


def test_continuous_coalescing_window_holds_new_prompts():
    engine, runner, clock = make(max_batch_size=8, batch_timeout_ms=5)
    engine.add_request("a", [1], greedy(50))
    clock.advance(0.006)
    engine.step()  # a runs
    engine.add_request("b", [1], greedy(1))
    engine.step()
    assert runner.batches[-1] == [("a", 1, 1)]  # b held for coalescing
    clock.advance(0.005)
    engine.step()
    assert ("b", 0, 1) in runner.batches[-1]


def test_prefill_first_runs_new_prompts_alone():
    engine, runner, _clock = make(prefill_mode="prefill_first", max_batch_size=4)
    engine.add_request("a", [1, 2, 3], greedy(5))
    engine.step()
    engine.step()
    engine.add_request("b", [4, 5], greedy(5))
    engine.step()
    assert runner.batches[-1] == [("b", 0, 2)]
    engine.step()
    assert sorted(runner.batches[-1]) == [("a", 4, 1), ("b", 2, 1)]


def test_merged_and_chunked_mixing():
    engine, runner, _ = make(prefill_mode="merged", max_num_batched_tokens=6)
    engine.add_request("a", [1, 2], greedy(5))
    engine.step()
    engine.add_request("b", [1, 2, 3, 4, 5, 6, 7], greedy(1))  # 7 > budget-1: waits whole
    engine.add_request("c", [1, 2, 3], greedy(1))
    engine.step()
    assert runner.batches[-1] == [("a", 2, 1)]  # b blocks the FCFS queue until it fits
    engine, runner, _ = make(prefill_mode="chunked", max_num_batched_tokens=6)
    engine.add_request("a", [1, 2], greedy(5))
    engine.step()
    engine.add_request("b", [1, 2, 3, 4, 5, 6, 7], greedy(1))
    engine.step()
    assert runner.batches[-1] == [("a", 2, 1), ("b", 0, 5)]  # decodes first, chunk fills the rest


def test_schedule_interval_and_waiting_served_ratio():
    engine, runner, _ = make(schedule_interval=3, max_batch_size=8)
    engine.add_request("a", [1], greedy(30))
    engine.step()
    engine.add_request("b", [1], greedy(1))
    engine.step()
    engine.step()
    assert all(rid != "b" for batch in runner.batches for rid, _, _ in batch)
    engine.step()
    assert ("b", 0, 1) in runner.batches[-1]

    engine, runner, _ = make(waiting_served_ratio=2.0, max_waiting_steps=4, max_batch_size=8)
    engine.add_request("a", [1], greedy(30))
    engine.step()
    engine.add_request("b", [1], greedy(1))
    for _ in range(3):
        engine.step()
    assert all(rid != "b" for batch in runner.batches for rid, _, _ in batch)  # 1/1 < 2
    engine.step()  # 4 steps without admission: forced
    assert ("b", 0, 1) in runner.batches[-1]


def test_preemption_puts_the_victim_back_at_the_head_and_recomputes():
    engine, _runner, clock = make(num_blocks=6, max_batch_size=4)
    engine.add_request("a", list(range(8)), greedy(8))  # needs 4 blocks at the end
    engine.add_request("b", list(range(8)), greedy(8))
    events = run_all(engine, clock)
    assert engine.stats().preemptions_total > 0
    outs = {}
    for e in events:
        outs.setdefault(e.request_id, []).extend(e.new_token_ids)
    assert outs["a"] == outs["b"] == reference_output(list(range(8)), 8)


def test_a_preempted_request_finding_its_own_blocks_is_no_prefix_cache_hit():
    """As vLLM counts them, prefix-cache hits are new requests' only: the tuner reads them as
    prompt work the cache saved, and a preempted request's own blocks are not that."""
    engine, _runner, clock = make(num_blocks=12, max_batch_size=4)
    for i, rid in enumerate("abcd"):  # nothing shared
        engine.add_request(rid, [100 * (i + 1) + k for k in range(12)], greedy(20))
    run_all(engine, clock)
    stats = engine.stats()
    assert stats.preemptions_total > 0
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4 * 12, 0)


def test_live_config_update_applies_next_step_and_ignores_restart_fields():
    engine, runner, _ = make(max_batch_size=1)
    for i in range(3):
        engine.add_request(str(i), [i + 1], greedy(10))
    engine.step()
    assert len(runner.batches[-1]) == 1
    ignored = engine.update_config(EngineConfig(max_batch_size=3, kv_block_size=32))
    assert ignored == ["kv_block_size"]
    assert engine.config.kv_block_size == 16 and engine.config.max_batch_size == 3
    assert engine.stats().config_generation == 2
    engine.step()
    assert len(runner.batches[-1]) == 3
    engine.update_config(EngineConfig(max_batch_size=1))  # shrinking sends the excess back to wait
    engine.step()
    assert len(runner.batches[-1]) == 1
    # not preemptions: the tuner reads those as KV pressure, and its own decrease made these
    assert (engine.stats().shed_total, engine.stats().preemptions_total) == (2, 0)


def test_a_failing_step_aborts_its_requests_and_the_engine_goes_on():
    engine, runner, clock = make()
    engine.add_request("a", [1, 2], greedy(4))
    real = runner.execute
    runner.execute = lambda out: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(StepFailedError):
        engine.step()
    runner.execute = real
    assert engine.block_manager.usage == 0
    engine.add_request("b", [1, 2], greedy(4))
    events = run_all(engine, clock)
    assert {(e.request_id, e.finish_reason) for e in events if e.finished} == {("a", "abort"), ("b", "length")}


def test_two_failing_steps_in_a_row_lose_no_final_event():
    # The first failure's aborts are reported with the next step; if that one fails too, their
    # events must still go out, or their clients wait forever.
    engine, runner, clock = make()
    engine.add_request("a", [1, 2], greedy(4))
    engine.add_request("b", [3, 4], greedy(4))
    real = runner.execute
    runner.execute = lambda out: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(StepFailedError):
        engine.step()
    engine.add_request("c", [5], greedy(4))
    with pytest.raises(StepFailedError):
        engine.step()
    runner.execute = real
    events = run_all(engine, clock)
    assert sorted(e.request_id for e in events if e.finished) == ["a", "b", "c"]


class FailingDecoder(LetterDecoder):
    """Fails on any text holding ``bad``: a tokenizer that cannot decode one token."""

    def __init__(self, bad):
        self.bad = bad

    def decode(self, ids, skip_special_tokens=True):
        if self.bad in ids:
            raise KeyError(self.bad)
        return super().decode(ids, skip_special_tokens)


def test_a_request_that_fails_past_the_runner_ends_alone():
    # Its detokenizer fails on its first token; the other request in the step goes on.
    bad_prompt, good_prompt = [5, 6, 7], [8, 9]
    engine, runner, clock = make(decoder=FailingDecoder(reference_output(bad_prompt, 1)[0]))
    engine.add_request("bad", bad_prompt, greedy(4))
    engine.add_request("good", good_prompt, greedy(4))
    events = run_all(engine, clock)
    finished = {e.request_id: e.finish_reason for e in events if e.finished}
    assert finished == {"bad": "abort", "good": "length"}
    assert [t for e in events if e.request_id == "good" for t in e.new_token_ids] == reference_output(good_prompt, 4)
    assert engine.block_manager.usage == 0 and "bad" in runner.released


def test_a_failing_kv_export_aborts_its_request_only():
    engine, runner, clock = make()
    runner.export_kv = lambda table, n: (_ for _ in ()).throw(MemoryError("no room to copy"))
    engine.add_request("export", [1, 2], greedy(2), export_kv=True)
    engine.add_request("plain", [3, 4], greedy(2))
    events = run_all(engine, clock)
    assert {e.request_id: e.finish_reason for e in events if e.finished} == {"export": "abort", "plain": "length"}
    assert engine.block_manager.usage == 0 and not engine.has_unfinished_requests()


def test_token_ids_outside_the_vocabulary_are_rejected():
    engine, runner, clock = make()
    vocab = re.escape(f"must be in [0, {runner.vocab_size})")
    with pytest.raises(InvalidRequestError, match=f"{vocab}, got -2"):
        engine.add_request("a", [1, -2], greedy(1))
    with pytest.raises(InvalidRequestError, match=f"{vocab}, got 1000"):
        engine.add_request("b", [1, runner.vocab_size], greedy(1))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.add_request("c", [1], SamplingParams(max_tokens=1, logit_bias={runner.vocab_size: 1.0}))
    assert not engine.has_unfinished_requests()  # nothing half-added
    engine.add_request("d", [runner.vocab_size - 1], greedy(1))
    assert [e.finish_reason for e in run_all(engine, clock)] == ["length"]


# --- events, stats, offline helper ---------------------------------------------------------------
def test_one_event_per_token_with_metrics_and_logprobs():
    engine, _, clock = make()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0, logprobs=1))
    clock.advance(0.5)
    events = run_all(engine, clock, dt=0.25)
    assert [len(e.new_token_ids) for e in events] == [1, 1, 1]
    assert [e.num_output_tokens for e in events] == [1, 2, 3]
    assert [e.finished for e in events] == [False, False, True]
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert all(e.logprobs and e.logprobs[0].token_id == e.new_token_ids[0] for e in events)
    m = events[-1].metrics
    assert (m.arrival_time, m.first_scheduled_time, m.first_token_time) == (0.0, 0.5, 0.5)
    assert m.last_token_time == m.finished_time == 1.0
    assert events[-1].num_prompt_tokens == 3


def test_stats_snapshot():
    engine, _, _ = make(num_blocks=10, max_batch_size=2)
    for i in range(3):
        engine.add_request(str(i), [1, 2, 3, 4, 5], greedy(4))
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks, stats.steps) == (2, 1, 10, 1)
    assert (stats.last_batch_size, stats.last_num_tokens) == (2, 10)
    assert stats.kv_usage == pytest.approx(0.4)  # 2 requests x 2 blocks of 4 slots
    assert stats.config_generation == 1 and stats.last_step_seconds >= stats.last_schedule_seconds >= 0


def test_context_limit_finishes_with_length():
    engine, _, clock = make()  # max_model_len 64
    engine.add_request("a", list(range(60)), greedy(4))
    events = run_all(engine, clock)
    assert events[-1].finish_reason == "length" and events[-1].num_output_tokens == 4


def test_generate_flushes_every_window_and_never_waits_on_the_clock():
    for knobs in ({"policy": "static", "max_batch_size": 8}, {"batch_timeout_ms": 60_000}, {"policy": "dynamic"}):
        engine, _, _ = make(**knobs)  # the fake clock never moves: a wait would hang
        prompts = [[1, 2], [3], [4, 5, 6]]
        assert engine.generate(prompts, greedy(3)) == [reference_output(p, 3) for p in prompts]
        assert engine.generate([[7]], greedy(2)) == [reference_output([7], 2)]  # fresh ids each call
    engine, _, _ = make()
    with pytest.raises(InvalidRequestError):
        engine.generate([[1], []], greedy(2))
    assert not engine.has_unfinished_requests() and engine.block_manager.usage == 0


# --- more policy behaviour -----------------------------------------------------------------------
def test_chunked_runs_decodes_before_prompt_chunks():
    # priority sorts the urgent long prompt ahead of the decode; the decode still goes first
    engine, runner, _ = make(max_num_batched_tokens=4, scheduling="priority", priority_age_weight=0)
    engine.add_request("short", [1], greedy(10), priority=0)
    engine.step()
    engine.add_request("long", list(range(20)), greedy(2), priority=5)
    engine.step()
    assert runner.batches[-1] == [("short", 1, 1), ("long", 0, 3)]
    engine.step()
    assert runner.batches[-1] == [("short", 2, 1), ("long", 3, 3)]


def test_switching_chunked_to_merged_finishes_half_done_prompts():
    engine, runner, clock = make(max_num_batched_tokens=4)
    engine.add_request("a", list(range(20)), greedy(3))
    engine.step()
    assert runner.batches[-1] == [("a", 0, 4)]
    engine.update_config(EngineConfig(max_num_batched_tokens=4, prefill_mode="merged"))
    engine.step()
    assert runner.batches[-1] == [("a", 4, 4)]  # a running request keeps being chunked
    events = run_all(engine, clock)
    assert [t for e in events for t in e.new_token_ids] == reference_output(list(range(20)), 3)


def test_fcfs_preempts_the_latest_arrival():
    engine, runner, _clock = make(num_blocks=4, max_batch_size=3)
    for i, name in enumerate("abc"):
        engine.add_request(name, [1, 2, 3], greedy(8), arrival_time=float(i))
    for _ in range(2):
        engine.step()  # each holds one block of 4 slots; a 5th token needs a second block
    assert engine.scheduler.num_preemptions == 0
    engine.step()  # a takes the last free block; b needs one: the latest arrival, c, goes
    assert runner.preempted[-1] == ["c"]
    assert [rid for rid, _, _ in runner.batches[-1]] == ["a", "b"]
    assert engine.scheduler.waiting[0].request_id == "c"  # back at the head of the queue


def test_priority_preempts_the_lowest_priority():
    engine, runner, _ = make(num_blocks=4, max_batch_size=3, scheduling="priority", priority_age_weight=0)
    for name, priority in (("a", 1), ("b", 0), ("c", 2)):
        engine.add_request(name, [1, 2, 3], greedy(8), priority=priority)
    for _ in range(3):
        engine.step()
    assert runner.preempted[-1] == ["b"]


def test_a_prompt_chunk_short_of_blocks_preempts_a_lower_priority_decode_already_in_the_step():
    # Decodes are scheduled before prompt chunks; the victim is still the lowest priority of all
    # running requests, taken out of the step again, not the urgent prompt itself.
    engine, runner, clock = make(
        num_blocks=4,
        max_num_batched_tokens=4,
        scheduling="priority",
        priority_age_weight=0,
        enable_prefix_caching=False,
    )
    engine.add_request("low", [1, 2], greedy(10), priority=0)
    events = engine.step()
    engine.add_request("high", list(range(12)), greedy(1), priority=10)
    events += run_all(engine, clock)
    preempted = [rid for step in runner.preempted for rid in step]
    assert preempted == ["low"]
    finished = [e.request_id for e in events if e.finished]
    assert finished == ["high", "low"]
    assert [t for e in events if e.request_id == "low" for t in e.new_token_ids] == reference_output([1, 2], 10)


def test_static_relaunches_a_preempted_request_without_waiting_for_a_full_batch():
    engine, _, clock = make(policy="static", max_batch_size=3, num_blocks=3, scheduling="priority")
    engine.add_request("a", [1, 2, 3], greedy(8), priority=0)
    engine.add_request("b", [1, 2, 3], greedy(8), priority=1)
    engine.flush()  # launch the partial batch of two
    while not engine.scheduler.num_preemptions:
        engine.step()
    engine.add_request("late", [1], greedy(1), priority=5)  # sorts ahead of the preempted one
    events = run_all(engine, clock)  # no flush: must not hang
    assert {e.request_id for e in events if e.finished} == {"a", "b", "late"}


def test_flush_launches_held_prompts_past_the_coalescing_window():
    engine, _, _ = make(batch_timeout_ms=1000)
    engine.add_request("a", [1], greedy(1))
    assert engine.step() == [] and engine.next_wakeup() == pytest.approx(1.0)
    engine.flush()
    assert engine.step()[0].request_id == "a"
    assert engine.next_wakeup() is None


def test_static_and_dynamic_prefill_whole_prompts_over_the_token_budget():
    engine, runner, clock = make(policy="static", max_batch_size=2, max_num_batched_tokens=4)
    engine.add_request("a", list(range(10)), greedy(2))
    engine.add_request("b", list(range(7)), greedy(2))
    engine.step()
    assert runner.batches[-1] == [("a", 0, 10), ("b", 0, 7)]
    run_all(engine, clock)


def test_switching_priority_back_to_fcfs_restores_arrival_order():
    engine, runner, clock = make(max_batch_size=2, scheduling="priority", priority_age_weight=0)
    engine.add_request("first", [1], greedy(6))
    engine.step()
    for name, priority in (("a", 0), ("b", 5), ("c", 9)):
        engine.add_request(name, [2], greedy(6), priority=priority)
        clock.advance(0.001)
    engine.step()  # sorted c, b, a: c takes the free slot, b and a wait in priority order
    engine.update_config(EngineConfig(max_batch_size=2, scheduling="fcfs"))
    run_all(engine, clock)
    assert [rid for step in admitted_per_step(runner) for rid in step] == ["first", "c", "a", "b"]
