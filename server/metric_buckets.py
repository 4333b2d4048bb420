"""The histogram bounds of the server's metrics, shared with the simulator so that both are read
through the same buckets (and so the same interpolation error) as Prometheus reads a real pod."""

from __future__ import annotations

# vLLM's buckets (seconds), each list a superset: every ``le`` a vLLM dashboard or alert names is
# here, plus finer steps from 100 ms to 7.5 s where latency SLOs sit. histogram_quantile
# interpolates linearly inside a bucket, so vLLM's 0.25-0.5 s or 1-2.5 s TTFT buckets read a p95
# tens of percent off; the tuner acts on these quantiles.
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.25,
    0.3,
    0.4,
    0.5,
    0.6,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    6.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.125,
    0.15,
    0.175,
    0.2,
    0.25,
    0.3,
    0.35,
    0.4,
    0.5,
    0.6,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
STEP_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]  # vLLM's: steps reach the budget
BYTES_BUCKETS = [2**k for k in range(10, 34, 2)]
N_BUCKETS = [1, 2, 5, 10, 20]  # vLLM's, for request_params_n
# A pool's start from zero: a process on loopback takes seconds, a pod pulling an image and
# loading a model minutes.
COLD_START_BUCKETS = [
    0.5,
    1.0,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
    90.0,
    120.0,
    180.0,
    300.0,
    600.0,
]


def length_buckets(max_model_len: int | None) -> list[float]:
    """vLLM's 1-2-5 series of request sizes in tokens, up to the context length."""
    top, scale, out = max_model_len or 1_000_000, 1, []
    while True:
        for step in (1, 2, 5):
            if step * scale > top:
                return out
            out.append(float(step * scale))
        scale *= 10
