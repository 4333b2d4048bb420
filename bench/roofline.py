"""Roofline figures for the engine bench, each against a ceiling measured in the same run:

- decode at batch B: a step reads every weight once and each request's KV cache, so it cannot
  beat ``bytes / bandwidth``, where bandwidth is a streaming read of a buffer far larger than
  the CPU's caches (``torch.sum``, several passes, the best); nor can it beat its FLOPs over the
  GEMM peak. Whichever bound is lower is the roof: at batch 32 in float32 on a CPU with wide
  vectors and few cores it is often the arithmetic, not the memory;
- prefill: a prompt step's FLOPs (2 per weight per token, plus causal attention) over its time,
  against the best GEMM rate measured here (oneDNN with a packed weight, and plain ``matmul``).
"""

from __future__ import annotations

import time

BANDWIDTH_BUFFER_BYTES = 1 << 30


def stream_bandwidth(passes: int = 5) -> float:
    """Bytes per second of a streaming read (``sum`` over a 1 GiB float32 buffer), the best pass."""
    import torch

    buffer = torch.ones(BANDWIDTH_BUFFER_BYTES // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return BANDWIDTH_BUFFER_BYTES / best


def gemm_peak(torch_dtype, n: int = 2048, reps: int = 4) -> float:
    """FLOP/s of the best of a packed oneDNN linear and ``matmul`` on (n, n) x (n, n)."""
    import torch

    a = torch.randn(n, n).to(torch_dtype)
    w = torch.randn(n, n).to(torch_dtype)
    runs = [lambda: a @ w]
    from llmfleet.server.runner.cpu_linear import enabled

    if enabled(torch.device("cpu"), torch_dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, n)
        runs.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    with torch.inference_mode():
        for run in runs:
            run()
            for _ in range(reps):
                start = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def model_sizes(model) -> dict[str, int]:
    """Matmul weights (every 2-D weight but the input embedding, which a step indexes rather than
    reads) and the per-token KV bytes per layer, read from a loaded HF model."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    matmul_params = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and p is not embedding)
    if head is not None and head.weight is embedding:  # tied: the head still reads it every step
        matmul_params += embedding.numel()
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return {
        "matmul_params": matmul_params,
        "layers": config.num_hidden_layers,
        "kv_dim": kv_heads * head_dim,
        "q_dim": heads * head_dim,
        "itemsize": embedding.element_size(),
    }


def decode_bound_tok_s(sizes: dict[str, int], batch: int, context: int, bandwidth: float) -> float:
    """Tokens/s if a decode step at ``batch`` (contexts of ``context`` tokens) ran at ``bandwidth``."""
    kv_bytes = batch * context * sizes["layers"] * 2 * sizes["kv_dim"] * sizes["itemsize"]
    step_bytes = sizes["matmul_params"] * sizes["itemsize"] + kv_bytes
    return batch * bandwidth / step_bytes


def decode_flops(sizes: dict[str, int], batch: int, context: int) -> float:
    """FLOPs of a decode step: 2 per weight per request, plus attention over each context."""
    return 2 * sizes["matmul_params"] * batch + 2 * 2 * sizes["layers"] * sizes["q_dim"] * batch * context


def decode_compute_bound_tok_s(sizes: dict[str, int], batch: int, context: int, peak_flops: float) -> float:
    """Tokens/s if a decode step at ``batch`` ran at the GEMM peak."""
    return batch * peak_flops / decode_flops(sizes, batch, context)


def prefill_flops(sizes: dict[str, int], prompts: int, prompt_len: int) -> float:
    """FLOPs of a prompt step: weights, then causal attention (scores and values, half the square)."""
    weights = 2 * sizes["matmul_params"] * prompts * prompt_len
    attention = 2 * 2 * sizes["layers"] * sizes["q_dim"] * prompts * prompt_len * (prompt_len + 1) / 2
    return weights + attention


def offline_floor_s(
    sizes: dict[str, int], prompt_lens: list[int], outputs: list[int], bandwidth: float, peak_flops: float
) -> float:
    """Seconds no engine can beat on an offline batch (every request at t=0) here: its prompts'
    FLOPs at the GEMM peak, then one decode step per output position, each at the higher of its
    read time (weights and the KV of the requests still decoding) and its FLOPs at the peak.
    Prompt steps and decode steps are counted apart, as if nothing overlapped them."""
    prompt_flops = sum(prefill_flops(sizes, 1, n) for n in prompt_lens)
    total = prompt_flops / peak_flops
    weight_bytes = sizes["matmul_params"] * sizes["itemsize"]
    kv_bytes_per_token = sizes["layers"] * 2 * sizes["kv_dim"] * sizes["itemsize"]
    for step in range(1, max(outputs)):  # the first output token comes with the prompt
        contexts = [p + step for p, n in zip(prompt_lens, outputs, strict=True) if n > step]
        read = (weight_bytes + kv_bytes_per_token * sum(contexts)) / bandwidth
        flops = sum(decode_flops(sizes, 1, c) for c in contexts)
        total += max(read, flops / peak_flops)
    return total
