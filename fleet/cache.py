"""Where llm-fleet keeps what it makes once and reuses: built-in models, compiled kernels and
calibration profiles."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$LLMFLEET_CACHE``, default ``~/.cache/llm-fleet``."""
    return Path(os.environ.get("LLMFLEET_CACHE") or Path.home() / ".cache" / "llm-fleet")
