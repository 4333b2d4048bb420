"""The shard group's shared-memory all-reduce: every shard gets the same bits, the sum in rank
order, for tensors larger than a slot and in bfloat16; a group any shard cannot join keeps gloo
and leaves no file; a shard that waits on one that exited says so instead of hanging. Threads
stand in for the shard processes (the parallel oracle runs the real ones)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from llmfleet.server.parallel import shared_sum

pytestmark = pytest.mark.skipif(not shared_sum.enabled(), reason="the shared-memory sum is for x86 hosts")


def join_all(size: int, directory) -> list:
    store = dist.HashStore()
    joined: list = [None] * size

    def one(rank: int) -> None:
        joined[rank] = shared_sum.join(store, rank, size, directory)

    threads = [threading.Thread(target=one, args=(rank,), name=f"rank-{rank}") for rank in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a shard is still waiting to join"
    return joined


def reduce_all(groups: list, tensors: list[torch.Tensor]) -> None:
    errors: list = []

    def one(rank: int) -> None:
        try:
            groups[rank].all_reduce(tensors[rank])
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


@pytest.fixture(autouse=True)
def fast_switches():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # spinning threads hand the GIL on quickly
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((3, 768), torch.float32), ((1200, 640), torch.float32), ((5, 4096), torch.bfloat16)],
    ids=["rows", "past-a-slot", "bf16"],
)
def test_every_shard_gets_the_sum_in_rank_order(tmp_path, shape, dtype):
    groups = join_all(3, tmp_path)
    assert all(isinstance(g, shared_sum.SharedMemorySum) for g in groups)
    assert list(tmp_path.iterdir()) == []  # mapped by all, so already unlinked
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):  # both sets of slots, and back
        parts = [torch.randn(shape, generator=generator).to(dtype) for _ in groups]
        want = (parts[0] + parts[1]) + parts[2]
        got = [p.clone() for p in parts]
        reduce_all(groups, got)
        for tensor in got:
            assert torch.equal(tensor, want)


def test_a_non_contiguous_tensor_is_summed_in_place(tmp_path):
    groups = join_all(2, tmp_path)
    base = [torch.arange(12.0).view(3, 4).t() * (rank + 1) for rank in range(2)]
    reduce_all(groups, base)
    assert torch.equal(base[0], torch.arange(12.0).view(3, 4).t() * 3)


def test_a_group_a_shard_cannot_join_keeps_gloo_and_leaves_no_file(tmp_path, monkeypatch, caplog):
    def elsewhere(path, nbytes):
        raise OSError("No such file or directory")  # a shard on another node, or in another pod

    monkeypatch.setattr(shared_sum, "_open", elsewhere)
    with caplog.at_level("INFO", logger=shared_sum.__name__):
        assert join_all(2, tmp_path) == [None, None]
    assert list(tmp_path.iterdir()) == []
    assert "sum through gloo: cannot map" in caplog.text
    assert "another shard cannot map the file" in caplog.text


def test_rank_0_turned_off_lets_the_others_go_on_to_gloo(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_sum, "enabled", lambda: threading.current_thread().name != "rank-0")
    assert join_all(3, tmp_path) == [None, None, None]
    assert list(tmp_path.iterdir()) == []


def test_turned_off_every_shard_keeps_gloo(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFLEET_SHM_ALLREDUCE", "0")
    assert join_all(2, tmp_path) == [None, None]
    assert list(tmp_path.iterdir()) == []


def test_a_shard_waiting_on_one_that_exited_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_sum, "_LIVENESS_EVERY_S", 0.05)
    groups = join_all(2, tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    groups[1]._words[1 * shared_sum._LINE + 1] = gone.pid  # shard 1's process, now exited
    with pytest.raises(shared_sum.PeerGone, match=f"tensor shard 1 \\(pid {gone.pid}\\) exited"):
        groups[0].all_reduce(torch.ones(4))


def test_a_peer_in_another_pid_namespace_is_not_taken_for_dead(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_sum, "_LIVENESS_EVERY_S", 0.0)
    groups = join_all(2, tmp_path)
    groups[1]._words[1 * shared_sum._LINE + 1] = 2**22 + 7  # no such pid here
    groups[1]._words[1 * shared_sum._LINE + 2] += 1  # another container's namespace
    groups[0]._check_alive(1)  # no PeerGone
