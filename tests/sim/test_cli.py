"""`llm-fleet sim` and `llm-fleet bench tuner` end to end on a tiny synthetic profile."""

from __future__ import annotations

import json

from llmfleet.cli import main
from llmfleet.sim.trace import builtin_workload, write_trace
from tests.sim.conftest import synthetic_profile


def tiny_profile(tmp_path):
    profile = synthetic_profile(intercept=0.002, tokens=5e-6, seqs=3e-5)
    profile.model, profile.max_model_len, profile.kv_bytes_per_token = "builtin:tiny", 2048, 512
    return profile.save(tmp_path / "tiny.json")


def test_sim_on_the_local_example(tmp_path, capsys, repo_root) -> None:
    profile = tiny_profile(tmp_path)
    code = main(["sim", "-f", str(repo_root / "examples/local.yaml"), "--profile", str(profile),
                 "--duration", "120", "--out", str(tmp_path / "out")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "SLO p95 TTFT 500 ms, ITL 100 ms: met in" in out and "replica-minutes" in out
    report = json.loads((tmp_path / "out/sim-tiny-bursty-tuner.json").read_text())
    assert report["summary"]["conserved"] and report["per_minute"] and report["timeline"]
    assert (tmp_path / "out/sim-tiny-bursty-tuner.png").stat().st_size > 10_000


def test_sim_from_a_trace_with_the_hpa(tmp_path, capsys, repo_root) -> None:
    trace = write_trace(tmp_path / "chat.jsonl", builtin_workload("chat", 60.0).requests())
    code = main(["sim", "-f", str(repo_root / "examples/local.yaml"), "--profile", str(tiny_profile(tmp_path)),
                 "--trace", str(trace), "--controller", "hpa", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    assert "controller hpa, 120 requests" in capsys.readouterr().out
    assert (tmp_path / "sim-tiny-chat-hpa.json").is_file()


def test_a_trace_is_replayed_as_it_is_and_its_warm_up_left_out_of_the_report(tmp_path, capsys, repo_root) -> None:
    trace = write_trace(tmp_path / "chat.jsonl", builtin_workload("chat", 120.0).requests())
    args = ["sim", "-f", str(repo_root / "examples/local.yaml"), "--profile", str(tiny_profile(tmp_path)),
            "--trace", str(trace), "--out", str(tmp_path)]  # fmt: skip
    assert main([*args, "--rate-scale", "2", "--seed", "3"]) == 2
    assert "--rate-scale, --seed shape a built-in workload" in capsys.readouterr().out
    assert main([*args, "--warmup", "60"]) == 0
    assert "reported after its first 60 s" in capsys.readouterr().out
    report = json.loads((tmp_path / "sim-tiny-chat-tuner.json").read_text())
    assert report["summary"]["measured_from_s"] == 60.0


def test_sim_explains_what_is_missing(tmp_path, capsys, repo_root, monkeypatch) -> None:
    monkeypatch.setenv("LLMFLEET_CACHE", str(tmp_path / "cache"))
    assert main(["sim", "-f", str(repo_root / "examples/local.yaml")]) == 2
    assert "run `llm-fleet calibrate --model builtin:tiny --quick` first" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0}\n')
    profile = str(tiny_profile(tmp_path))
    assert main(["sim", "-f", str(repo_root / "examples/local.yaml"), "--profile", profile, "--trace", str(bad)]) == 2
    assert "bad.jsonl:1: missing prompt_tokens, output_tokens" in capsys.readouterr().out


def test_bench_tuner_quick(tmp_path, capsys) -> None:
    profile = synthetic_profile().save(tmp_path / "small.json")
    code = main(["bench", "tuner", "--quick", "--workloads", "chat", "--profile", str(profile),
                 "--out", str(tmp_path), "--workers", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "== targets" in out and "best fixed" in out and "HPA baseline" in out
    result = json.loads((tmp_path / "tuner_eval.json").read_text())
    row = result["workloads"][0]
    assert row["workload"] == "chat" and set(row["checks"]) >= {"attainment", "vs_best_fixed", "vs_hpa"}
    assert (tmp_path / "tuner_eval.png").is_file()


def test_the_tuner_bench_defaults_to_the_reference_profile() -> None:
    """The profile the tuner bench's SLOs were set for ships with the package and loads."""
    from llmfleet.bench.tuner_eval import REFERENCE_PROFILE
    from llmfleet.sim.cost_model import CostModel

    cost = CostModel.load(REFERENCE_PROFILE)
    assert (cost.model, cost.dtype, cost.device) == ("builtin:small", "float32", "cpu")
    assert cost.describe().startswith("59.80 ms + 1824.9 us/token")
