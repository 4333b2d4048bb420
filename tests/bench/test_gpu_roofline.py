"""The GPU roofline bench's arithmetic, and a run of it end to end on a CPU with builtin:tiny."""

from __future__ import annotations

import json

from llmfleet.bench import gpu_roofline

# a model of Llama-3.2-1B's shape, as bench/roofline.py's model_sizes reads it
LLAMA_1B = {"matmul_params": 1_235_746_816, "layers": 16, "kv_dim": 512, "q_dim": 2048, "itemsize": 2}
HEAD = 128256 * 2048


def test_a_decode_step_reads_every_weight_once_and_each_requests_kv():
    weights = LLAMA_1B["matmul_params"] * 2
    kv_per_token = 16 * 2 * 512 * 2  # layers, K and V, kv_dim, bytes
    assert gpu_roofline.decode_step_bytes(LLAMA_1B, 1, 1) == weights + kv_per_token
    assert gpu_roofline.decode_step_bytes(LLAMA_1B, 64, 512) == weights + 64 * 512 * kv_per_token


def test_a_prefill_step_runs_the_lm_head_for_each_prompts_last_token_only():
    per_token_without_head = 2 * (LLAMA_1B["matmul_params"] - HEAD)
    one = gpu_roofline.prefill_step_flops(LLAMA_1B, HEAD, 1, 1)
    assert one == per_token_without_head + 2 * HEAD + 2 * 2 * 16 * 2048  # one token attends to itself
    two = gpu_roofline.prefill_step_flops(LLAMA_1B, HEAD, 2, 1024)
    attention = 2 * 2 * 16 * 2048 * 2 * 1024 * 1025 / 2
    assert two == per_token_without_head * 2048 + 2 * HEAD * 2 + attention


def test_it_runs_on_a_cpu_and_writes_its_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_roofline, "read_bandwidth", lambda device: {"sum": 2e10, "copy": 1e10, "roof": 2e10})
    monkeypatch.setattr(gpu_roofline, "matmul_peak", lambda device, dtype: 1e11)
    out = tmp_path / "figures.json"
    argv = ["--model", "builtin:tiny", "--device", "cpu", "--dtype", "float32", "--batches", "2", "4"]
    argv += ["--context", "31", "--prefill-tokens", "64", "--prompt-len", "32", "--reps", "2", "--rounds", "1"]
    assert gpu_roofline.main([*argv, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [row["batch"] for row in figures["decode"]] == [2, 4]
    assert all(row["context"] == 32 and row["eager_ms"] > 0 for row in figures["decode"])
    assert "graphs_ms" not in figures["decode"][0]  # no CUDA graphs on a CPU
    (prefill,) = figures["prefill"]
    assert prefill["tokens"] == 64 and prefill["prompt_len"] == 32 and prefill["eager_of_peak"] > 0
    printed = capsys.readouterr().out
    assert "decode batch 4 x 32 tokens" in printed and "prefill 64 tokens (2 x 32)" in printed
