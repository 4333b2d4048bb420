"""`llm-fleet sim` and `llm-fleet bench tuner` end to end on a tiny synthetic profile."""

from __future__ import annotations

import json
import sys

import pytest

from llmfleet.cli import main
from llmfleet.sim.trace import builtin_workload, read_trace, write_trace
from llmfleet.workloads import RequestSpec
from tests.fleet.sim.conftest import synthetic_profile


def tiny_profile(tmp_path):
    profile = synthetic_profile(intercept=0.002, tokens=5e-6, seqs=3e-5)
    profile.model, profile.max_model_len, profile.kv_bytes_per_token = "builtin:tiny", 2048, 512
    return profile.save(tmp_path / "tiny.json")


def test_sim_on_the_local_example(tmp_path, capsys, repo_root) -> None:
    profile = tiny_profile(tmp_path)
    code = main(
        [
            "sim",
            "-f",
            str(repo_root / "examples/local.yaml"),
            "--profile",
            str(profile),
            "--duration",
            "120",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "SLO p95 TTFT 500 ms, ITL 100 ms: met in" in out and "replica-minutes" in out
    assert "note: the profile was measured on" not in out  # builtin:tiny's own profile
    report = json.loads((tmp_path / "out/sim-tiny-bursty-tuner.json").read_text())
    assert report["summary"]["conserved"] and report["per_minute"] and report["timeline"]
    assert (tmp_path / "out/sim-tiny-bursty-tuner.png").stat().st_size > 10_000


def test_sim_writes_every_tuner_run_with_what_held_each_knob_and_count(tmp_path, capsys, repo_root) -> None:
    args = ["sim", "-f", str(repo_root / "examples/local.yaml"), "--profile", str(tiny_profile(tmp_path))]
    runs = tmp_path / "runs/tuner.jsonl"
    assert main([*args, "--duration", "120", "--out", str(tmp_path / "out"), "--runs", str(runs)]) == 0
    assert f"tuner runs to {runs}" in capsys.readouterr().out
    lines = [json.loads(line) for line in runs.read_text().splitlines()]
    report = json.loads((tmp_path / "out/sim-tiny-bursty-tuner.json").read_text())
    # every run, not only those that moved something: one per autotune interval (10 s)
    assert len(lines) >= 11 and len(lines) > len(report["decisions"])
    assert [line["at_s"] for line in lines] == sorted(line["at_s"] for line in lines)
    assert all(set(line) == {"at_s", "replicas", "changes", "hold", "reasons"} for line in lines)
    assert all(line["reasons"] and set(line["replicas"]) == {"colocated"} for line in lines)
    quiet = [line for line in lines if not line["changes"]]
    assert quiet and all(any(" stays " in r or " held: " in r for r in line["reasons"]) for line in quiet)
    moved = [line for line in lines if line["changes"]]
    assert len(moved) == len([d for d in report["decisions"] if d["changes"]])
    assert main([*args, "--duration", "30", "--controller", "hpa", "--runs", str(runs)]) == 2
    assert "--runs records the tuner's runs; the controller here is hpa" in capsys.readouterr().out


def test_sim_says_when_the_profile_is_another_models(tmp_path, capsys, repo_root) -> None:
    profile = synthetic_profile(intercept=0.002, tokens=5e-6, seqs=3e-5)
    profile.model, profile.max_model_len, profile.kv_bytes_per_token = "builtin:small", 2048, 512
    args = ["sim", "-f", str(repo_root / "examples/local.yaml"), "--profile", str(profile.save(tmp_path / "s.json"))]
    assert main([*args, "--duration", "30", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "note: the profile was measured on builtin:small, not builtin:tiny" in out


def test_sim_from_a_trace_with_the_hpa(tmp_path, capsys, repo_root) -> None:
    trace = write_trace(tmp_path / "chat.jsonl", builtin_workload("chat", 60.0).requests())
    code = main(
        [
            "sim",
            "-f",
            str(repo_root / "examples/local.yaml"),
            "--profile",
            str(tiny_profile(tmp_path)),
            "--trace",
            str(trace),
            "--controller",
            "hpa",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    assert "controller hpa, 120 requests" in capsys.readouterr().out
    assert (tmp_path / "sim-tiny-chat-hpa.json").is_file()


def test_a_trace_is_replayed_as_it_is_and_its_warm_up_left_out_of_the_report(tmp_path, capsys, repo_root) -> None:
    trace = write_trace(tmp_path / "chat.jsonl", builtin_workload("chat", 120.0).requests())
    args = [
        "sim",
        "-f",
        str(repo_root / "examples/local.yaml"),
        "--profile",
        str(tiny_profile(tmp_path)),
        "--trace",
        str(trace),
        "--out",
        str(tmp_path),
    ]
    assert main([*args, "--rate-scale", "2", "--duration", "60"]) == 2
    assert "--duration, --rate-scale shape a built-in workload" in capsys.readouterr().out
    assert main([*args, "--warmup", "60"]) == 0
    assert "reported after its first 60 s" in capsys.readouterr().out
    report = json.loads((tmp_path / "sim-tiny-chat-tuner.json").read_text())
    assert report["summary"]["measured_from_s"] == 60.0


def test_an_azure_csv_trace_is_cut_thinned_and_capped(tmp_path, capsys, repo_root) -> None:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:{m:02d}:{s:02d}.5000000,{100 + s},{5000 + s}" for m in range(4) for s in range(0, 60, 2)]
    trace = tmp_path / "azure.csv"
    trace.write_text("\n".join(rows) + "\n")
    args = ["sim", "-f", str(repo_root / "examples/local.yaml"), "--profile", str(tiny_profile(tmp_path))]
    args += ["--out", str(tmp_path), "--trace", str(trace), "--save-trace", str(tmp_path / "used.jsonl")]
    cut = ["--trace-start", "60", "--trace-duration", "120", "--thin", "0.5", "--max-output-tokens", "8"]
    assert main([*args, *cut, "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "window 60-180 s, thinned to 0.5 (seed 1), outputs capped at 8" in out
    used = read_trace(tmp_path / "used.jsonl")
    assert 10 <= len(used) <= 50 and all(r.output_len == 8 and r.arrival_s < 120 for r in used)
    assert main([*args[:-4], "--thin", "0.5"]) == 2
    assert "--thin cut a --trace" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args, "--trace-match", "Model"])
    assert "--trace-match: expected FIELD=VALUE, got 'Model'" in capsys.readouterr().err


def test_sim_explains_what_is_missing(tmp_path, capsys, repo_root, monkeypatch) -> None:
    monkeypatch.setenv("LLMFLEET_CACHE", str(tmp_path / "cache"))
    assert main(["sim", "-f", str(repo_root / "examples/local.yaml")]) == 2
    assert "run `llm-fleet calibrate --model builtin:tiny --quick` first" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0}\n')
    profile = str(tiny_profile(tmp_path))
    assert main(["sim", "-f", str(repo_root / "examples/local.yaml"), "--profile", profile, "--trace", str(bad)]) == 2
    assert "bad.jsonl:1: a JSONL trace needs arrival_s, " in (out := capsys.readouterr().out)
    assert out.rstrip().endswith("; missing prompt_tokens, output_tokens")


def test_bench_tuner_quick(tmp_path, capsys) -> None:
    profile = synthetic_profile().save(tmp_path / "small.json")
    code = main(
        [
            "bench",
            "tuner",
            "--quick",
            "--workloads",
            "chat",
            "--profile",
            str(profile),
            "--out",
            str(tmp_path),
            "--workers",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "== targets" in out and "best fixed" in out and "best HPA target" in out and "oracle" in out
    result = json.loads((tmp_path / "tuner_eval.json").read_text())
    row = result["workloads"][0]
    assert row["workload"] == "chat" and set(row["checks"]) >= {"attainment", "vs_fixed", "vs_hpa", "scale_down_lag"}
    assert row["oracle"]["replica_minutes"] > 0 and row["scale_down_lag_s"] >= 0
    assert (tmp_path / "tuner_eval.png").is_file()


def test_bench_tuner_judges_a_trace_of_your_own(tmp_path, capsys) -> None:
    """`bench tuner --trace`: a user's request log cut as the sim cuts it, judged against the
    SLOs given, beside the fixed grid, the HPA targets and the oracle."""
    profile = synthetic_profile().save(tmp_path / "small.json")
    requests = [RequestSpec(i * 0.5, 64 + 16 * (i % 5), 8 + (i % 7)) for i in range(720)]  # 6 minutes at 2 req/s
    trace = write_trace(tmp_path / "ours.jsonl", requests)
    argv = ["bench", "tuner", "--quick", "--trace", str(trace), "--trace-start", "30", "--trace-duration", "300"]
    argv += ["--ttft-ms", "2000", "--itl-ms", "300", "--warmup", "60", "--max-replicas", "3"]
    argv += ["--scale-down-window-s", "60", "--initial-replicas", "2", "--router-policy", "prefix"]
    code = main([*argv, "--profile", str(profile), "--out", str(tmp_path), "--workers", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "'scaleDownStabilizationSeconds': 60" in out and "the tuner and the HPA start at 2 pods" in out
    assert "; router policy prefix" in out
    assert "ours.jsonl: 600 requests, window 30-330 s, prompts capped at 2048, outputs capped at 512" in out
    assert "best fixed" in out and "best HPA target" in out and "oracle" in out
    result = json.loads((tmp_path / "tuner_eval.json").read_text())
    assert result["router_policy"] == "prefix"
    (row,) = result["workloads"]
    assert row["workload"] == "ours" and row["tuner"]["slo_minutes"] == 4  # the 240 s after the warm-up


def test_bench_tuner_reads_a_trace_of_your_own_once_a_draw(tmp_path, capsys, monkeypatch) -> None:
    """A long log takes a while to read: each draw is read once, checked, and handed to every run
    on it (the worker processes, forked, would count their own reads in the same file)."""
    from llmfleet.sim import trace as trace_module

    reads = tmp_path / "reads"

    def counted(*args, **kwargs):
        with reads.open("a") as out:
            out.write("read\n")
        return read_trace(*args, **kwargs)

    monkeypatch.setattr(trace_module, "read_trace", counted)
    profile = synthetic_profile().save(tmp_path / "small.json")
    trace = write_trace(tmp_path / "ours.jsonl", [RequestSpec(i * 0.5, 64, 8) for i in range(600)])
    argv = ["bench", "tuner", "--tuner-only", "--quick", "--trace", str(trace), "--thin", "0.5", "--seeds", "1,2"]
    argv += ["--ttft-ms", "2000", "--itl-ms", "300", "--warmup", "60", "--max-replicas", "2"]
    assert main([*argv, "--profile", str(profile), "--out", str(tmp_path), "--workers", "2"]) == 0
    assert reads.read_text().count("read") == 2
    rows = json.loads((tmp_path / "tuner_alone.json").read_text())["workloads"]
    assert sorted((r["seed"], r["predictive"]) for r in rows) == [(1, False), (1, True), (2, False), (2, True)]
    assert "/2; minutes met " in capsys.readouterr().out


def test_bench_tuner_says_what_a_trace_of_your_own_lacks(tmp_path, capsys) -> None:
    trace = write_trace(tmp_path / "ours.jsonl", [RequestSpec(i * 1.0, 64, 8) for i in range(100)])
    base = ["bench", "tuner", "--trace", str(trace), "--out", str(tmp_path)]
    slos = ["--ttft-ms", "2000", "--itl-ms", "300"]
    for argv, why in [
        (base, "--trace needs the SLOs it is judged on: --ttft-ms and --itl-ms"),
        ([*base, *slos, "--workloads", "chat"], "--trace replaces the bench's workloads: leave out --workloads"),
        ([*base, *slos, "--trace-duration", "200"], "--trace-duration 200 leaves nothing after the 300 s --warmup"),
        ([*base, *slos, "--initial-replicas", "13"], "--initial-replicas 13 is above --max-replicas 12"),
        ([*base, *slos], f"no request of {trace} arrives after the 300 s warm-up: nothing to judge"),
        ([*base[:3], str(tmp_path / "none.csv"), *base[4:], *slos], "cannot read the trace: "),
        ([*base, *slos, "--trace-match", "tenant=a"], f"trace {trace}: no request where tenant = a"),
    ]:
        assert main(argv) == 2, argv
        assert why in capsys.readouterr().out, argv


def test_the_tuner_bench_defaults_to_the_reference_profile() -> None:
    """The profile the tuner bench's SLOs were set for ships with the package and loads."""
    from llmfleet.bench.tuner_eval import REFERENCE_PROFILE
    from llmfleet.sim.cost_model import CostModel

    cost = CostModel.load(REFERENCE_PROFILE)
    assert (cost.model, cost.dtype, cost.device) == ("builtin:small", "float32", "cpu")
    assert cost.describe().startswith("59.80 ms + 1824.9 us/token")


def local_example_with(tmp_path, repo_root, **engine) -> str:
    """examples/local.yaml with more engine fields in its pool."""
    import yaml

    service = yaml.safe_load((repo_root / "examples/local.yaml").read_text())
    service["spec"]["pools"]["colocated"]["engine"].update(engine)
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(service))
    return str(path)


def test_sim_honours_the_pools_max_model_len_and_refuses_one_past_the_models(tmp_path, capsys, repo_root) -> None:
    profile = str(tiny_profile(tmp_path))  # max_model_len 2048
    trace = write_trace(tmp_path / "t.jsonl", [RequestSpec(0.0, 500, 10), RequestSpec(1.0, 100, 10)])
    service = local_example_with(tmp_path, repo_root, maxModelLen=256)
    assert main(["sim", "-f", service, "--profile", profile, "--trace", str(trace), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "{'rejected': 1, 'finished': 1}" in out
    assert "why: 1 rejected: 400 from colocated-1: This model's maximum context length is 256 tokens" in out
    report = json.loads((tmp_path / "sim-tiny-t-tuner.json").read_text())
    assert [r["count"] for r in report["summary"]["reasons"]] == [1]

    service = local_example_with(tmp_path, repo_root, maxModelLen=4096)
    assert main(["sim", "-f", service, "--profile", profile, "--trace", str(trace), "--out", str(tmp_path)]) == 2
    assert "pool colocated: engine.maxModelLen 4096 exceeds the model's limit 2048" in capsys.readouterr().out


def test_sim_refuses_a_run_with_nothing_to_report(tmp_path, capsys, repo_root, monkeypatch) -> None:
    monkeypatch.setattr("llmfleet.sim.simulate.simulate", _not_to_be_run)
    args = [
        "sim",
        "-f",
        str(repo_root / "examples/local.yaml"),
        "--profile",
        str(tiny_profile(tmp_path)),
        "--out",
        str(tmp_path),
    ]
    for shape in (["--duration", "0.5"], ["--rate-scale", "0.00001"]):
        assert main([*args, *shape]) == 2
        assert "bursty generates no requests: give it a longer --duration or a larger --rate-scale" in (
            capsys.readouterr().out
        )
    trace = write_trace(tmp_path / "one.jsonl", [RequestSpec(0.0, 100, 10)])
    assert main([*args, "--trace", str(trace), "--warmup", "5"]) == 2
    assert "--warmup 5 covers the whole trace" in capsys.readouterr().out


def test_sim_checks_its_output_paths_before_simulating(tmp_path, capsys, repo_root, monkeypatch) -> None:
    monkeypatch.setattr("llmfleet.sim.simulate.simulate", _not_to_be_run)
    args = [
        "sim",
        "-f",
        str(repo_root / "examples/local.yaml"),
        "--profile",
        str(tiny_profile(tmp_path)),
        "--workload",
        "chat",
        "--duration",
        "10",
    ]
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for flags, message in (
        (["--save-trace", str(tmp_path)], f"cannot write --save-trace {tmp_path}: {tmp_path} is a directory"),
        (["--out", str(a_file)], f"cannot write --out {a_file}: {a_file} is a file, not a directory"),
        (["--out", str(a_file / "results")], f"cannot write --out {a_file / 'results'}: cannot write into"),
    ):
        assert main([*args, *flags]) == 2
        out = capsys.readouterr().out
        assert message in out and "Traceback" not in out


def test_sim_refuses_a_profile_it_cannot_run(tmp_path, capsys, repo_root) -> None:
    data = json.loads(tiny_profile(tmp_path).read_text()) | {"device": None}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    args = [
        "sim",
        "-f",
        str(repo_root / "examples/local.yaml"),
        "--profile",
        str(tmp_path / "bad.json"),
        "--workload",
        "chat",
        "--duration",
        "10",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 2
    assert f"bad cost profile {tmp_path / 'bad.json'}: device must be a non-empty string" in capsys.readouterr().out


def test_calibrate_checks_its_output_path_before_measuring(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("llmfleet.sim.calibrate.calibrate", _not_to_be_run)
    assert main(["calibrate", "--quick", "--out", str(tmp_path)]) == 2
    assert f"llm-fleet calibrate: cannot write the profile: {tmp_path} is a directory" in capsys.readouterr().out


def _not_to_be_run(*args, **kwargs):
    raise AssertionError("ran before its arguments were checked")


def test_without_matplotlib_the_json_is_written_and_a_hint_given(tmp_path, capsys, repo_root, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    args = ["sim", "-f", str(repo_root / "examples/local.yaml"), "--profile", str(tiny_profile(tmp_path))]
    assert main([*args, "--workload", "chat", "--duration", "30", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(no PNG: matplotlib is not installed; pip install 'llm-fleet[bench]' adds it)" in out
    assert (tmp_path / "sim-tiny-chat-tuner.json").is_file() and not (tmp_path / "sim-tiny-chat-tuner.png").exists()
