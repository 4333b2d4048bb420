"""`llm-fleet bench` refuses a wrong command line in one line, exit 2, before a model loads or a
server starts: bad numbers in the parser, an unusable --out, model, device, port or profile in
the check that runs first."""

from __future__ import annotations

import socket

import pytest

from llmfleet.bench import disagg_bench, engine_bench, pipeline_bench, router_bench, server_bench, sim_fidelity
from llmfleet.cli import main

BAD_NUMBERS = [
    (["engine", "--online-requests", "0"], "--online-requests: must be >= 1, got 0"),
    (["engine", "--batch", "1.5"], "--batch: not a whole number: '1.5'"),
    (["engine", "--rate", "0"], "--rate: must be > 0, got 0"),
    (["engine", "--thread-counts", "1,0"], "--thread-counts: must be >= 1, got 0"),
    (["engine", "--thread-counts", ","], "--thread-counts: no numbers in ','"),
    (["sim-fidelity", "--budget", "-1"], "--budget: must be >= 1, got -1"),
    (["sim-fidelity", "--batch", "0"], "--batch: must be >= 1, got 0"),
    (["sim-fidelity", "--rates", "0.3,-1"], "--rates: must be > 0, got -1"),
    (["sim-fidelity", "--rates", " , "], "--rates: no numbers in ' , '"),
    (["sim-fidelity", "--requests", "0"], "--requests: must be >= 1, got 0"),
    (["disagg", "--disagg-rate-scale", "nan"], "--disagg-rate-scale: must be finite, got nan"),
    (["disagg", "--disagg-requests", "0"], "--disagg-requests: must be >= 1, got 0"),
    (["disagg", "--disagg-threads", "0"], "--disagg-threads: must be >= 1, got 0"),
    (["tuner", "--workers", "0"], "--workers: must be >= 1, got 0"),
    (["tuner", "--startup-s", "-5"], "--startup-s: must be >= 0, got -5"),
    (["tuner", "--seeds", "default,abc"], "--seeds: 'abc' is neither a whole number nor 'default'"),
    (["tuner", "--seeds", "11,12,11"], "--seeds: 11 is given twice"),
    (["tuner", "--seeds", " , "], "--seeds: no seeds in ' , '"),
    (["router", "--conversations", "0"], "--conversations: must be >= 1, got 0"),
    (["router", "--turns", "0"], "--turns: must be >= 1, got 0"),
    (["server", "--clients", "0"], "--clients: must be >= 1, got 0"),
    (["server", "--rounds", "0"], "--rounds: must be >= 1, got 0"),
    (["server", "--port", "70000"], "--port: must be between 1 and 65535, got 70000"),
    (["engine", "--dtype", "fp8"], "--dtype: must be one of auto, float32, bfloat16, float16, half, float, got 'fp8'"),
]


@pytest.fixture(autouse=True)
def no_bench_runs(monkeypatch):
    """Every bench's run fails the test: a refused command line never reaches one."""

    def ran(args):
        raise AssertionError(f"bench {args.which} ran")

    for module in (engine_bench, server_bench, disagg_bench, router_bench, sim_fidelity, pipeline_bench):
        monkeypatch.setattr(module, "run", ran)


@pytest.mark.parametrize(("argv", "message"), BAD_NUMBERS)
def test_a_bad_number_is_the_parsers_error(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"llm-fleet bench: error: argument {message}" in err


def test_a_dtype_alias_is_read_as_its_name(tmp_path) -> None:
    from llmfleet.cli import build_parser

    args = build_parser(only="bench").parse_args(["bench", "--dtype", "half", "--rates", "0.5,,1"])
    assert args.dtype == "float16" and args.rates == [0.5, 1.0]


def _refused(argv: list[str], capsys) -> str:
    assert main(["bench", *argv]) == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1, out.err  # one line
    return out.err


def test_out_that_is_a_file_is_refused(tmp_path, capsys) -> None:
    taken = tmp_path / "results"
    taken.write_text("")
    for which in ("engine", "server", "disagg", "router", "sim-fidelity", "tuner", "pipeline"):
        err = _refused([which, "--out", str(taken)], capsys)
        assert f"llm-fleet bench {which}: cannot write --out {taken}: {taken} is a file, not a directory" in err


def test_out_that_cannot_be_written_is_refused(capsys) -> None:
    assert "cannot write --out /proc/bench" in _refused(["engine", "--out", "/proc/bench"], capsys)


def test_a_model_path_that_is_no_model_is_refused(tmp_path, capsys) -> None:
    err = _refused(["engine", "--model", str(tmp_path / "nope"), "--out", str(tmp_path)], capsys)
    assert "a local directory with a config.json, nor a Hugging Face repository" in err
    err = _refused(["server", "--model", "builtin:huge", "--out", str(tmp_path)], capsys)
    assert "unknown built-in model 'huge'" in err


@pytest.fixture
def no_model_made(tmp_path, monkeypatch):
    """An empty model cache that must stay empty: the checks make no built-in (a fresh machine's
    first one printed transformers' progress bar before the one-line error)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LLMFLEET_CACHE", str(cache))
    yield
    assert not any(cache.rglob("config.json"))


def test_a_device_torch_cannot_use_is_refused(tmp_path, capsys, no_model_made) -> None:
    import torch

    args = ["engine", "--model", "builtin:tiny", "--out", str(tmp_path)]
    assert "--device tpu9:" in _refused([*args, "--device", "tpu9"], capsys)
    if not torch.cuda.is_available():
        assert "--device cuda: this torch sees no CUDA device" in _refused([*args, "--device", "cuda"], capsys)


def test_more_threads_than_cores_is_refused_where_vllm_binds_them(tmp_path, capsys, no_model_made) -> None:
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    args = ["engine", "--model", "builtin:tiny", "--out", str(tmp_path), "--only-vllm"]
    err = _refused([*args, "--thread-counts", f"1,{cores + 1}"], capsys)
    assert f"--thread-counts {cores + 1}: the bench may run on {cores} CPU core(s) here" in err


def test_a_port_in_use_is_refused(tmp_path, capsys, no_model_made) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _refused(["server", "--model", "builtin:tiny", "--port", str(port), "--out", str(tmp_path)], capsys)
    assert f"cannot listen on 127.0.0.1:{port}" in err


def test_sim_fidelity_refuses_a_missing_profile_unless_asked_to_calibrate(tmp_path, capsys) -> None:
    base = ["sim-fidelity", "--model", "builtin:tiny", "--out", str(tmp_path / "out")]
    missing = tmp_path / "none.json"
    err = _refused([*base, "--profile", str(missing)], capsys)
    assert f"no cost profile at {missing}: pass --calibrate to make one" in err
    blocked = tmp_path / "file"
    blocked.write_text("")
    err = _refused([*base, "--calibrate", "--profile", str(blocked / "p.json")], capsys)
    assert f"cannot save the profile to {blocked / 'p.json'}: {blocked} is a file, not a directory" in err
    with pytest.raises(AssertionError, match="bench sim-fidelity ran"):  # calibrating a missing one is fine
        main(["bench", *base, "--calibrate", "--profile", str(missing)])


@pytest.mark.parametrize("bench", ["sim-fidelity", "tuner"])
def test_a_cost_profile_that_is_no_profile_is_one_line(bench, tmp_path, capsys) -> None:
    bad, folder = tmp_path / "list.json", tmp_path / "profiles"
    bad.write_text("[1]")
    folder.mkdir()
    base = ["--model", "builtin:tiny"] if bench == "sim-fidelity" else ["--tuner-only"]
    for profile, says in ((bad, "a cost profile is a JSON object"), (folder, "Is a directory")):
        err = _refused([bench, *base, "--out", str(tmp_path / "out"), "--profile", str(profile)], capsys)
        assert f"cost profile {profile}" in err and says in err


def test_the_structured_output_ratio_is_the_json_object_speed() -> None:
    """What is stored is what is printed: JSON-object throughput over plain (below 1: slower)."""
    assert engine_bench.json_object_speed({"plain": 1.0, "json_object": 1.25}) == 0.8


def test_the_disagg_plot_shows_every_measured_workload(tmp_path, monkeypatch) -> None:
    import matplotlib.axes

    shown = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks", lambda self, ticks, labels: shown.append(list(labels)))
    run = {"throughput_tok_s": 10.0, "ttft_p99": 1.0, "itl_p99": 0.1}
    results = {"model": "m", "threads": 2, "engine": {"dtype": "float32"}}
    results |= {shape: {"colocated": run, "disaggregated": run} for shape in ("creative", "long-prompt", "chat")}
    disagg_bench._plot(results, tmp_path / "p.png")
    assert shown == [["creative", "long-prompt", "chat"]] * 3
