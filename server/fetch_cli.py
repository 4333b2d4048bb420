"""`llm-fleet fetch-model`: download a Hugging Face model into a cache and print where it lies.

The operator's storage initializer runs it as a pod's init container (``--download-dir`` on the
pool's cache volume, ``HF_TOKEN`` from the spec's Secret); the server container then finds the
model there with ``HF_HUB_OFFLINE=1``. The same code `llm-fleet serve --model org/name` runs.
"""

from __future__ import annotations

import sys

from llmfleet.server.core.model_uri import parse_hub
from llmfleet.server.runner.hub import HubError, fetch

HELP = "download a Hugging Face model (hf://org/name[@revision]) into a cache and print its directory"


def add_arguments(parser) -> None:
    parser.add_argument("model", metavar="MODEL", help="hf://org/name, hf://org/name@revision, or org/name")
    parser.add_argument(
        "--download-dir",
        help="the cache to fill (default: $HF_HUB_CACHE, ~/.cache/huggingface/hub); "
        "`llm-fleet serve --download-dir` loads from it",
    )


def run(args) -> int:
    try:
        path = fetch(parse_hub(args.model), args.download_dir)
    except (ValueError, HubError) as exc:
        print(f"llm-fleet fetch-model: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
