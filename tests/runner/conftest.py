"""Runner tests use one torch thread: the tiny models gain nothing from more, and on a shared
2-core machine two spinning OpenMP threads made these tests up to 8x slower under load."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
