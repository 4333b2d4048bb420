"""CPU steps keep the memory they free (a prompt step must not page-fault its buffers in again),
and the engine's commands run under tcmalloc where the system has it."""

from __future__ import annotations

import ctypes.util
import os
import platform
import resource
import subprocess
import sys

import numpy as np
import pytest

from llmfleet.server.runner.host_memory import (
    HUGE_PAGES_ENV,
    LARGE_ALLOC_REPORT_ENV,
    TCMALLOC_ENV,
    ask_for_huge_pages,
    ask_for_tcmalloc,
    keep_freed_host_memory,
)

MB = 1 << 20


def one_step() -> int:
    """A prompt step's allocations: 48 activation buffers of 1-1.2 MB alive at once, then all
    freed. Returns the bytes it touched."""
    buffers = [np.empty(MB + 4096 * i, dtype=np.uint8) for i in range(48)]
    for buffer in buffers:
        buffer.fill(1)
    return sum(b.nbytes for b in buffers)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_a_second_step_reuses_the_pages_the_first_one_freed() -> None:
    assert keep_freed_host_memory() and keep_freed_host_memory()  # once per process, then cached
    one_step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    touched = one_step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # glibc's own thresholds: 13,400 faults here (each buffer mapped afresh); kept, none
    assert faults < 0.05 * touched / resource.getpagesize()


def test_huge_pages_are_asked_for_unless_the_user_chose() -> None:
    assert ask_for_huge_pages({})[HUGE_PAGES_ENV] == "1"
    assert ask_for_huge_pages({HUGE_PAGES_ENV: "0"})[HUGE_PAGES_ENV] == "0"


def test_the_cli_asks_for_huge_pages_before_torch_is_imported() -> None:
    """torch reads the setting once, when it is imported: a subcommand that imported it first
    would leave its weights and KV cache on small pages."""
    code = """
import os, sys
from llmfleet import cli
class Subcommand:
    HELP = "a subcommand that reports what it found"
    add_arguments = staticmethod(lambda parser: None)
    @staticmethod
    def run(args):
        print(os.environ.get("THP_MEM_ALLOC_ENABLE"), "torch" in sys.modules)
        return 0
cli._load = lambda name: Subcommand
sys.exit(cli.main(["sim"]))
"""
    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGES_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "False"]


def test_tcmalloc_goes_first_on_ld_preload_where_the_system_has_it(monkeypatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: f"lib{name}.so.4" if name == "tcmalloc" else None)
    env = ask_for_tcmalloc({"LD_PRELOAD": "libfoo.so"})
    assert env["LD_PRELOAD"] == "libtcmalloc.so.4:libfoo.so"
    assert int(env[LARGE_ALLOC_REPORT_ENV]) > 1 << 30  # a KV cache is one allocation: no report for it
    assert ask_for_tcmalloc({LARGE_ALLOC_REPORT_ENV: "5"})[LARGE_ALLOC_REPORT_ENV] == "5"
    assert ask_for_tcmalloc(dict(env)) == env  # a restarted process does not start again


def test_the_users_choice_of_allocator_stands(monkeypatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: f"lib{name}.so.4")
    assert "LD_PRELOAD" not in ask_for_tcmalloc({TCMALLOC_ENV: "0"})
    assert ask_for_tcmalloc({"LD_PRELOAD": "/opt/libjemalloc.so.2"})["LD_PRELOAD"] == "/opt/libjemalloc.so.2"
    assert ask_for_tcmalloc({TCMALLOC_ENV: "/opt/alloc.so"})["LD_PRELOAD"] == "/opt/alloc.so"
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert ask_for_tcmalloc({}) == {}  # none on the system: glibc's malloc, nothing said


RESTART = """
import os, sys
from llmfleet.server.runner.host_memory import restart_under_tcmalloc
restart_under_tcmalloc([sys.executable, "-c", "import os; print('restarted', os.environ['LD_PRELOAD'])"])
print("not restarted")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux's loader's")
def test_a_process_starts_again_under_the_allocator_once() -> None:
    libc = ctypes.util.find_library("c")  # any library the loader can preload harmlessly
    env = {**os.environ, TCMALLOC_ENV: libc, "LD_PRELOAD": ""}
    out = subprocess.run([sys.executable, "-c", RESTART], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["restarted", libc]
    env["LD_PRELOAD"] = libc
    out = subprocess.run([sys.executable, "-c", RESTART], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["not", "restarted"]
