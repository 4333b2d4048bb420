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


# The C kernels as built for this CPU, and for AVX2 (8 floats a vector, where AVX-512 has 16):
# machines of either kind run the kernels, and the narrower build's passes and register blocks
# are other code. x86 only; skipped where this CPU or compiler cannot run or build it.
KERNEL_BUILDS = {"native": "native", "AVX2": "x86-64-v3"}


@pytest.fixture(params=KERNEL_BUILDS)
def kernel_build(request, monkeypatch):
    """The C kernels of one build in place of the native one, for the test that asks for it."""
    from llmfleet.server.runner import cpu_kernels

    march = KERNEL_BUILDS[request.param]
    if march != "native":
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                flags = next((line.split() for line in cpuinfo if line.startswith("flags")), [])
        except OSError:
            flags = []
        if not {"avx2", "fma"} <= set(flags):
            pytest.skip(f"this CPU cannot run a -march={march} build")
        library = cpu_kernels.build_for(march)
        if library is None:
            pytest.skip(f"no -march={march} build of the kernels here")
        monkeypatch.setattr(cpu_kernels, "_library", lambda: library)
    return request.param
