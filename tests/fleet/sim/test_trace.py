"""Workload traces: JSONL read and write, built-in workloads, warm-ups, and clear errors."""

from __future__ import annotations

import json
import time

import pytest

from llmfleet.sim.trace import TraceError, TraceOptions, builtin_workload, read_trace, with_warmup, write_trace
from llmfleet.workloads import BURSTY, RequestSpec


def test_round_trip(tmp_path) -> None:
    requests = builtin_workload("chat", duration_s=30.0).requests()
    path = write_trace(tmp_path / "t" / "chat.jsonl", requests)
    back = read_trace(path)
    assert [(r.prompt_len, r.output_len) for r in back] == [(r.prompt_len, r.output_len) for r in requests]
    assert [r.arrival_s for r in back] == pytest.approx([r.arrival_s for r in requests], abs=1e-6)


def test_sorted_by_arrival_blank_lines_and_extra_keys(tmp_path) -> None:
    lines = [
        {"arrival_s": 2.0, "prompt_tokens": 5, "output_tokens": 1, "user": "b"},
        {"arrival_s": 1, "prompt_tokens": 7, "output_tokens": 2},
        {"arrival_s": 2.0, "prompt_tokens": 9, "output_tokens": 3},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n" + json.dumps(lines[2]) + "\n")
    assert read_trace(path) == [RequestSpec(1.0, 7, 2), RequestSpec(2.0, 5, 1), RequestSpec(2.0, 9, 3)]


def test_arrivals_count_from_the_first_so_log_timestamps_replay_as_they_happened(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    epoch = 1_764_000_000.5  # Unix seconds, as a log has them
    path.write_text(
        "".join(
            json.dumps({"arrival_s": epoch + i / 4, "prompt_tokens": 3, "output_tokens": 1}) + "\n" for i in range(3)
        )
    )
    assert [r.arrival_s for r in read_trace(path)] == [0.0, 0.25, 0.5]


@pytest.mark.parametrize("last", [1_700_000_000.0, 1e300, 366 * 86_400.0 + 1])
def test_a_trace_spanning_more_than_a_year_is_refused(tmp_path, last) -> None:
    # offsets from the start mixed with Unix timestamps would idle for decades of simulated seconds
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(json.dumps({"arrival_s": t, "prompt_tokens": 3, "output_tokens": 1}) + "\n" for t in (0.0, 1.5, last))
    )
    with pytest.raises(TraceError, match=r"t.jsonl: its arrivals span .* days .*mix offsets .* with Unix timestamps"):
        read_trace(path)


def test_a_trace_of_months_replays(tmp_path) -> None:
    path = tmp_path / "t.jsonl"  # BurstGPT's third log spans 110 days
    path.write_text(
        "".join(
            json.dumps({"arrival_s": t, "prompt_tokens": 3, "output_tokens": 1}) + "\n" for t in (0.0, 110 * 86_400.0)
        )
    )
    assert [r.arrival_s for r in read_trace(path)] == [0.0, 110 * 86_400.0]


@pytest.mark.parametrize(("content", "message"), [("\n\n", "holds no requests"), (b"\xff\xfe", "cannot read trace")])
@pytest.mark.parametrize("name", ["t.jsonl", "t.csv"])
def test_an_empty_or_binary_trace_is_an_error(tmp_path, content, message, name) -> None:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_a_jsonl_trace_may_begin_with_a_byte_order_mark(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\ufeff" + json.dumps({"arrival_s": 0.5, "prompt_tokens": 3, "output_tokens": 1}) + "\n")
    assert [(r.arrival_s, r.prompt_len) for r in read_trace(path)] == [(0.5, 3)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "t.jsonl:2: not JSON"),
        ("[1, 2, 3]", "t.jsonl:2: expected an object"),
        ('{"arrival_s": 1, "prompt_tokens": 3}', "t.jsonl:2: missing output_tokens"),
        ('{"arrival_s": -1, "prompt_tokens": 3, "output_tokens": 1}', "arrival_s must be a finite number >= 0"),
        ('{"arrival_s": NaN, "prompt_tokens": 3, "output_tokens": 1}', "arrival_s must be a finite number >= 0"),
        ('{"arrival_s": true, "prompt_tokens": 3, "output_tokens": 1}', "arrival_s must be a finite number >= 0"),
        ('{"arrival_s": 1, "prompt_tokens": 0, "output_tokens": 1}', "prompt_tokens must be an integer >= 1, got 0"),
        ('{"arrival_s": 1, "prompt_tokens": 3, "output_tokens": 2.5}', "output_tokens must be an integer >= 1"),
        ('{"arrival_s": 1, "prompt_tokens": 3, "output_tokens": 2147483648}', "output_tokens 2147483648 is past any"),
    ],
)
def test_bad_traces_name_the_line(tmp_path, line, message) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 1}\n' + line + "\n")
    with pytest.raises(TraceError, match=message.replace("[", r"\[")):
        read_trace(path)


def test_missing_trace(tmp_path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")


def test_builtin_workloads() -> None:
    chat = builtin_workload("chat", duration_s=60.0, rate_scale=2.0)
    assert chat.rate_per_s == 4.0 and chat.num_requests == 240
    bursty = builtin_workload("bursty", duration_s=BURSTY.duration_s / 2, rate_scale=2.0)
    assert bursty.duration_s == pytest.approx(BURSTY.duration_s / 2)
    assert [rate for _, rate in bursty.phases] == [2 * rate for _, rate in BURSTY.phases]
    assert builtin_workload("anyscale-online").prompt_len == (1, 512)
    with pytest.raises(ValueError, match="unknown workload 'rag'"):
        builtin_workload("rag")
    with pytest.raises(ValueError, match="rate_scale must be > 0"):
        builtin_workload("chat", rate_scale=0)


def test_warm_up_prefix() -> None:
    workload = builtin_workload("bursty")
    requests = with_warmup(workload, 100.0)
    warm = [r for r in requests if r.arrival_s < 100.0]
    rest = requests[len(warm) :]
    assert 60 <= len(warm) <= 140  # the opening phase's 1 request/s
    assert [r.arrival_s - 100.0 for r in rest] == pytest.approx([r.arrival_s for r in workload.requests()])
    assert with_warmup(workload, 0.0) == workload.requests()


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109

2023-11-16 18:16:51.2224670,8790,55
"""


def test_the_azure_csv_format_reads_as_offsets_from_its_first_request(tmp_path) -> None:
    path = tmp_path / "conv.csv"
    path.write_text("\ufeff" + AZURE)
    requests = read_trace(path)
    assert [(r.prompt_len, r.output_len) for r in requests] == [(374, 44), (396, 109), (8790, 55)]
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, 4.314579, 64.541877])


def test_a_window_thinning_and_caps_cut_a_trace(tmp_path) -> None:
    path = tmp_path / "conv.csv"
    path.write_text(AZURE)
    window = read_trace(path, TraceOptions(start_s=4.0, duration_s=100.0, max_prompt_tokens=2048))
    assert [(round(r.arrival_s, 3), r.prompt_len, r.output_len) for r in window] == [
        (0.315, 396, 109),
        (60.542, 2048, 55),
    ]
    many = write_trace(tmp_path / "many.jsonl", [RequestSpec(i * 0.1, 10, 10) for i in range(2000)])
    kept = [read_trace(many, TraceOptions(thin=0.25, seed=seed)) for seed in (1, 2)]
    assert all(450 <= len(k) <= 550 for k in kept)
    assert kept[0] != kept[1]  # each seed another draw
    assert read_trace(many, TraceOptions(thin=0.25, seed=1)) == kept[0]  # the same seed the same draw
    with pytest.raises(TraceError, match="no request left after window 500-600 s"):
        read_trace(many, TraceOptions(start_s=500.0, duration_s=100.0))
    with pytest.raises(ValueError, match="thin must be a fraction"):
        TraceOptions(thin=0.0)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "t.jsonl",
            '{"arrival_s": 1, "input_length": 3}\n',
            ":1: a JSONL trace needs .*; missing prompt_tokens, output_tokens$",
        ),
        (
            "t.jsonl",
            '{"timestamp": 1, "input_length": 3}\n',
            r"\(llm-fleet\) or timestamp, .*\(Mooncake\); missing output_length$",
        ),
        (
            "t.jsonl",
            '{"timestamp": -1, "input_length": 3, "output_length": 1}\n',
            ":1: timestamp must be a finite number >= 0",
        ),
        ("t.csv", "TIMESTAMP,ContextTokens\n1,2\n", ":1: a CSV trace needs TIMESTAMP, .* missing GeneratedTokens$"),
        (
            "t.csv",
            "Timestamp,Model,Request tokens\n5,x,2\n",
            r"\(Azure\) or Timestamp, .*\(BurstGPT\); missing Response tokens$",
        ),
        ("t.csv", "Timestamp,Request tokens,Response tokens\nnoon,2,3\n", ":2: Timestamp 'noon' is neither seconds"),
        ("t.csv", "Timestamp,Request tokens,Response tokens\n5,2,-1\n", ":2: Response tokens must be an integer >= 1"),
        ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,2,3\n", ":2: TIMESTAMP 'yesterday' is neither"),
        (
            "t.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n1.5,2,0\n",
            ":2: GeneratedTokens must be an integer >= 1, got 0",
        ),
        (
            "t.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n1.5,x,3\n",
            ":2: ContextTokens must be an integer >= 1, got 'x'",
        ),
        (
            "t.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n1.5,9999999999,3\n",
            ":2: ContextTokens 9999999999 is past any model's",
        ),
    ],
)
def test_a_trace_of_no_known_format_or_a_bad_row_names_its_line(tmp_path, name, text, message) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_the_2024_azure_format_with_zones_reads_in_order_from_a_window(tmp_path) -> None:
    # Azure's 2024 traces: a week of requests, zone-qualified timestamps; a replay takes a window
    path = tmp_path / "week.csv"
    path.write_text(
        "\n\nTIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        "2024-05-10 00:00:00.009930+00:00,2162,5\r\n"
        "2024-05-10 01:00:00.500000+00:00,76,15\r\n"
        "2024-05-10 00:59:59.000000+00:00,2376,1\r\n"  # out of order: read by arrival
        "2024-05-10 03:00:00.009930+02:00,7670,8\r\n"  # another zone: 01:00:00.00993 UTC
    )
    window = read_trace(path, TraceOptions(start_s=3000.0, duration_s=1000.0))
    assert [(round(r.arrival_s, 3), r.prompt_len) for r in window] == [(598.99, 2376), (600.0, 7670), (600.49, 76)]
    path.write_bytes(path.read_bytes().replace(b",15\r", b",none\r"))
    with pytest.raises(TraceError, match=r"week\.csv:5: GeneratedTokens must be an integer >= 1, got 'none'"):
        read_trace(path)  # the line in the file, blank lines above the header counted


def test_a_timestamp_without_a_zone_is_utc_whatever_the_local_zone(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TZ", "Europe/Berlin")  # clocks went 02:00 -> 03:00 on 2024-03-31
    time.tzset()
    try:
        path = tmp_path / "t.csv"
        path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-03-31 00:30:00,3,1\n2024-03-31 03:30:00,3,1\n")
        assert [r.arrival_s for r in read_trace(path)] == [0.0, 3 * 3600.0]
    finally:
        monkeypatch.undo()
        time.tzset()


def test_mooncake_traces_read_in_milliseconds_with_their_prompts_blocks(tmp_path) -> None:
    # Mooncake's FAST'25 traces (as Dynamo and AIPerf replay them): milliseconds from the first
    # request, and hash_ids naming each prompt's blocks of 512 tokens; a capped prompt keeps the
    # blocks that still hold its tokens
    path = tmp_path / "conversation_trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1500, "output_length": 500, "hash_ids": [0, 1, 2]},
        {"timestamp": 3052, "input_length": 600, "output_length": 316, "hash_ids": [0, 3]},
        {"timestamp": 1500, "input_length": 300, "output_length": 1, "hash_ids": [4]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cut = read_trace(path, TraceOptions(max_prompt_tokens=1024))
    assert cut == [
        RequestSpec(0.0, 1024, 500, (0, 1), 512),
        RequestSpec(1.5, 300, 1, (4,), 512),
        RequestSpec(3.052, 600, 316, (0, 3), 512),
    ]
    path.write_text(path.read_text() + '{"timestamp": 4000, "input_length": 0, "output_length": 3}\n')
    with pytest.raises(TraceError, match=r"trace\.jsonl:4: input_length must be an integer >= 1, got 0"):
        read_trace(path)


@pytest.mark.parametrize(
    ("row", "error"),
    [
        ('"hash_ids": [0, -1]', "hash_ids must be a list of integers >= 0"),
        ('"hash_ids": "0,1"', "hash_ids must be a list of integers >= 0"),
        ('"hash_ids": [0, true]', "hash_ids must be a list of integers >= 0"),
        ('"hash_ids": [1.5]', "hash_ids must be a list of integers >= 0"),
        ('"hash_ids": [1], "block_tokens": 0', "block_tokens must be an integer >= 1, got 0"),
    ],
)
def test_content_blocks_must_be_ids(tmp_path, row, error) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{"timestamp": 0, "input_length": 9, "output_length": 3, {row}}}\n')
    with pytest.raises(TraceError, match=rf"t\.jsonl:1: {error}"):
        read_trace(path)


def test_a_saved_trace_keeps_the_prompts_blocks(tmp_path) -> None:
    # blocks from the second request on: the rows before them read as sharing nothing
    requests = [RequestSpec(0.0, 30, 2), RequestSpec(1.0, 100, 4, (1, 2), 64), RequestSpec(2.0, 5, 1)]
    requests.append(RequestSpec(3.0, 70, 3, (1, 5), 64))
    path = write_trace(tmp_path / "saved.jsonl", requests)
    assert read_trace(path) == requests


def test_burstgpt_traces_read_and_leave_out_failed_requests(tmp_path) -> None:
    # BurstGPT's columns, its extra ones ignored, its Timestamp seconds from midnight of its first
    # day (kept: a window counts from that midnight); a failed request has 0 response tokens
    path = tmp_path / "BurstGPT_1.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,GPT-4,1087,0,1087,API log\n"
        "118.5,GPT-4,417,276,693,Conversation log\n"
    )
    assert read_trace(path) == [RequestSpec(5.0, 472, 18), RequestSpec(118.5, 417, 276)]


def test_a_replay_can_keep_only_the_rows_a_field_picks(tmp_path) -> None:
    # BurstGPT logs two models and two kinds of log in one file: a fleet serves one model
    path = tmp_path / "BurstGPT_1.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,GPT-4,1087,20,1107,API log\n"
        "118.5,GPT-4,417,276,693,Conversation log\n"
    )
    gpt4 = (("Model", "GPT-4"),)
    assert read_trace(path, TraceOptions(match=gpt4)) == [RequestSpec(45.0, 1087, 20), RequestSpec(118.5, 417, 276)]
    both = TraceOptions(match=(*gpt4, ("Log Type", "API log")))
    assert read_trace(path, both) == [RequestSpec(45.0, 1087, 20)]
    assert both.describe() == "Model = GPT-4, Log Type = API log"
    with pytest.raises(TraceError, match=r"BurstGPT_1\.csv:1: no column 'model' to match; it has Timestamp, Model, "):
        read_trace(path, TraceOptions(match=(("model", "GPT-4"),)))
    with pytest.raises(TraceError, match=r"no request where Model = Claude$"):
        read_trace(path, TraceOptions(match=(("Model", "Claude"),)))
    # a JSONL key matches as text, or as its JSON where it is not text; a row without it does not
    jsonl = tmp_path / "tenants.jsonl"
    rows = [{"tenant": "a", "tier": 1}, {"tenant": "b", "tier": 2}, {"tier": 1}, {"tenant": "a", "tier": True}]
    jsonl.write_text(
        "".join(
            json.dumps({"arrival_s": i, "prompt_tokens": 5, "output_tokens": 2} | r) + "\n" for i, r in enumerate(rows)
        )
    )
    assert [r.arrival_s for r in read_trace(jsonl, TraceOptions(match=(("tier", "1"),)))] == [0.0, 2.0]
    assert [r.arrival_s for r in read_trace(jsonl, TraceOptions(match=(("tenant", "a"),)))] == [0.0, 3.0]
    assert [r.arrival_s for r in read_trace(jsonl, TraceOptions(match=(("tier", "true"),)))] == [3.0]


@pytest.mark.parametrize("compress", ["gzip", "bz2", "lzma"])
def test_a_compressed_trace_reads_as_it_decompresses_whatever_its_name(tmp_path, compress) -> None:
    import importlib

    module = importlib.import_module(compress)
    csv_text = "TIMESTAMP,ContextTokens,GeneratedTokens\n0.5,374,44\n4.8,396,109\n"
    for name in ("conv.csv.gz", "conv.csv"):  # a compressed log keeps its name, or loses it
        path = tmp_path / name
        path.write_bytes(module.compress(csv_text.encode()))
        assert read_trace(path) == [RequestSpec(0.5, 374, 44), RequestSpec(4.8, 396, 109)]
    lines = [RequestSpec(1.0, 3, 1), RequestSpec(2.0, 5, 2)]
    jsonl = write_trace(tmp_path / "t.jsonl", lines)
    packed = tmp_path / "t.jsonl.xz"
    packed.write_bytes(module.compress(jsonl.read_bytes()))
    assert read_trace(packed) == lines
    packed.write_bytes(module.compress(jsonl.read_bytes())[:-8])  # cut short in transit
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(packed)
