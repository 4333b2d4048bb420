"""Where the runner tests run: the CPU, unless LLMFLEET_TEST_DEVICE names another device (e.g. `cuda`
on a machine with a GPU). The HF oracle runs on the same device, so both sides use the same kernels."""

from __future__ import annotations

import os

DEVICE = os.environ.get("LLMFLEET_TEST_DEVICE", "cpu")
