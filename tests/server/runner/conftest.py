"""Runner tests use one torch thread: the tiny models gain nothing from more, and on a shared
2-core machine two spinning OpenMP threads made these tests up to 8x slower under load.

On a GPU (LLMFLEET_TEST_DEVICE=cuda) engines capture CUDA graphs lazily: each test builds its own
engines and steps through a few shapes, so capturing every shape at start-up would dominate."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("LLMFLEET_CUDA_GRAPHS", "lazy")


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
