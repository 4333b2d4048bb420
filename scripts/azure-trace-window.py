"""Cut the tuner bench's window out of the public Azure LLM inference trace (2023).

The trace is Microsoft's AzurePublicDataset (github.com/Azure/AzurePublicDataset, data/
AzureLLMInferenceTrace_conv.csv: an hour of a production LLM service's conversation requests,
TIMESTAMP, ContextTokens, GeneratedTokens), licensed CC-BY 4.0. This keeps minutes 10 to 45 of
it (the rate rises by 60% between minutes 20 and 31 and falls back by minute 47) and a seeded
quarter of their requests, in the trace's own format; `llm-fleet bench tuner` thins that again
per seed so builtin:small needs 3-10 pods (docs/benchmarks.md).

    python scripts/azure-trace-window.py AzureLLMInferenceTrace_conv.csv bench/traces/azure-conv-2023-window.csv
"""

from __future__ import annotations

import argparse
import csv
import random
from datetime import datetime

START_S, DURATION_S, KEEP, SEED = 600.0, 2100.0, 0.25, 2023


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="AzureLLMInferenceTrace_conv.csv from AzurePublicDataset")
    parser.add_argument("out", help="where to write the window")
    args = parser.parse_args()
    rng = random.Random(SEED)
    with open(args.source, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], [r for r in rows[1:] if r]
    first = datetime.fromisoformat(body[0][0])
    kept = [
        r
        for r in body
        if START_S <= (datetime.fromisoformat(r[0]) - first).total_seconds() < START_S + DURATION_S
        and rng.random() < KEEP
    ]
    with open(args.out, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(kept)
    print(f"wrote {len(kept)} of {len(body)} requests to {args.out}")


if __name__ == "__main__":
    main()
