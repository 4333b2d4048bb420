"""One fresh engine process for the engine bench's warm-up comparison (run as a module).

It builds the engine (with its start-up warm-up, or without it under LLMFLEET_WARM_UP=0), then
runs one prompt of each padded step size up to the default budget, twice: the first pass pays
whatever kernel builds the warm-up left, the second none. Prints JSON seconds."""

from __future__ import annotations

import json
import sys
import time


def main(model: str, dtype: str) -> None:
    from llmfleet.server.config import EngineConfig
    from llmfleet.server.core.request import SamplingParams
    from llmfleet.server.engine.build import build_engine
    from llmfleet.server.runner.step_shapes import warm_up_sizes

    config = EngineConfig(dtype=dtype, enable_prefix_caching=False)
    started = time.perf_counter()
    engine, _ = build_engine(model, config, device="cpu")
    result = {"build_s": time.perf_counter() - started}
    greedy = SamplingParams(max_tokens=1, temperature=0)
    for name in ("first_pass_s", "second_pass_s"):
        started = time.perf_counter()
        for size in warm_up_sizes(config.max_num_batched_tokens):
            engine.generate([[11] * size], greedy)
        result[name] = time.perf_counter() - started
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
