"""The tensor shards' all-reduce through shared memory, for shards on one x86 host's CPUs.

gloo's all-reduce goes through its TCP transport even on loopback, and a stage's shards run two
of them per layer. So shards that can all map one file in ``/dev/shm`` sum there instead: each
writes its partial product into a slot of its own, raises its counter, waits for every peer's
counter, then adds the slots up in rank order, so every shard gets the same bits. Two sets of
slots alternate: a shard that has seen every counter reach call k knows every peer has finished
reading call k-1, so the set of call k+1 is free. Tensors larger than a slot go in pieces.

The waits spin, then nap: a step's all-reduces are microseconds apart. x86 keeps
stores in order and loads in order, which is all the protocol needs from the memory, so other
CPUs (and any group that cannot map the file, such as shards on two nodes or in two pods) keep
gloo. ``LLMFLEET_SHM_ALLREDUCE=0`` keeps gloo everywhere.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SLOT_BYTES = 2 << 20  # a shard's share of one call (larger tensors go in pieces)
_HEADER = 4096  # per rank: its counter, pid and pid namespace, a cache line from the others'
_LINE = 8  # int64s in a cache line
# A peer that is a few microseconds behind is met spinning; one that is descheduled or still
# computing is waited for in naps, which leave the core to whatever else this host runs.
_SPINS_BEFORE_NAPS = 2000
_NAP_S = 50e-6
_LIVENESS_EVERY_S = 1.0
SHM_DIR = Path("/dev/shm")


def enabled() -> bool:
    return os.environ.get("LLMFLEET_SHM_ALLREDUCE", "1") != "0" and platform.machine() in ("x86_64", "AMD64")


class PeerGone(RuntimeError):
    """A shard this one waits for has exited."""


class SharedMemorySum:
    """``all_reduce(tensor)``: the sum over the group, in place, as ``dist.all_reduce`` does."""

    def __init__(self, mapping: mmap.mmap, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self._words = memoryview(mapping).cast("B")[:_HEADER].cast("q")
        self._data = torch.frombuffer(mapping, dtype=torch.uint8, offset=_HEADER, count=2 * size * SLOT_BYTES).view(
            2, size, SLOT_BYTES
        )
        self._calls = 0
        self._namespace = _pid_namespace()
        self._words[rank * _LINE + 1] = os.getpid()
        self._words[rank * _LINE + 2] = self._namespace

    def all_reduce(self, tensor: torch.Tensor) -> None:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        per_piece = SLOT_BYTES // flat.element_size()
        for start in range(0, flat.numel(), per_piece):
            self._sum_piece(flat[start : start + per_piece])
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))

    def _sum_piece(self, piece: torch.Tensor) -> None:
        self._calls += 1
        call = self._calls
        nbytes = piece.numel() * piece.element_size()
        slots = self._data[call & 1, :, :nbytes].view(piece.dtype)
        slots[self.rank].copy_(piece)
        self._words[self.rank * _LINE] = call  # after the data: x86 keeps stores in order
        for peer in range(self.size):
            if peer != self.rank:
                self._wait(peer, call)
        torch.add(slots[0], slots[1], out=piece)
        for peer in range(2, self.size):
            piece.add_(slots[peer])

    def _wait(self, peer: int, call: int) -> None:
        counter = peer * _LINE
        words = self._words
        spins = 0
        checked = time.monotonic()
        while words[counter] < call:
            spins += 1
            if spins < _SPINS_BEFORE_NAPS:
                continue
            time.sleep(_NAP_S)
            if spins % 256 == 0 and time.monotonic() - checked > _LIVENESS_EVERY_S:
                checked = time.monotonic()
                self._check_alive(peer)

    def _check_alive(self, peer: int) -> None:
        pid, namespace = self._words[peer * _LINE + 1], self._words[peer * _LINE + 2]
        if namespace != self._namespace:
            return  # a pid from another container's namespace means nothing here
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise PeerGone(f"tensor shard {peer} (pid {pid}) exited mid all-reduce") from None
        except PermissionError:
            pass  # alive, someone else's


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def join(store, rank: int, size: int, directory: Path = SHM_DIR) -> SharedMemorySum | None:
    """Every shard of the group calls this with the group's store: a SharedMemorySum for each if
    all of them could map rank 0's file, else None for each (they keep gloo)."""
    if size < 2:
        return None
    nbytes = _HEADER + 2 * size * SLOT_BYTES
    mapping, problem = None, ""
    if rank == 0:  # always names a file or none: the other shards wait for this key
        path = directory / f"llmfleet-shards-{os.getpid()}-{secrets.token_hex(8)}"
        if not enabled():
            problem = "off here"
        else:
            try:
                mapping = _create(path, nbytes)
            except OSError as exc:
                problem = f"cannot create {path}: {exc}"
        store.set("shm-path", "" if mapping is None else str(path))
    elif not enabled():
        problem = "off here"
    else:
        name = store.get("shm-path").decode()
        try:
            mapping = _open(Path(name), nbytes) if name else None
            problem = "" if mapping else "rank 0 made no file"
        except OSError as exc:
            problem = f"cannot map {name}: {exc}"
    store.set(f"shm-ok-{rank}", "" if problem else "1")
    agreed = all(store.get(f"shm-ok-{r}") == b"1" for r in range(size))  # waits for every shard
    if rank == 0 and mapping is not None:
        path.unlink(missing_ok=True)  # every shard has mapped it or given up: nothing is left behind
    if not agreed:
        log.info("tensor shards sum through gloo: %s", problem or "another shard cannot map the file")
        if mapping is not None:
            mapping.close()
        return None
    if rank == 0:
        log.info("tensor shards sum through shared memory (%d of them)", size)
    return SharedMemorySum(mapping, rank, size)


def _create(path: Path, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # a full /dev/shm fails here, not as SIGBUS at a write
        mapping = mmap.mmap(fd, nbytes)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return mapping


def _open(path: Path, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != nbytes:
            raise OSError(f"{path} is not this group's file")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
