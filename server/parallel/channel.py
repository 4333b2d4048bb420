"""Messages between the engine process and the workers, over a torch.distributed process group.

Objects go as a pickled byte tensor behind an 8-byte length; tensors go as they are. Sends are
asynchronous (a gloo send waits for its receiver, and a worker may be busy with an earlier
batch): the caller keeps the returned ``Outbox`` until the receiver has had the message.
Each kind of message has its own tag, so a worker's logits and its KV export never cross.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch


class Tag(IntEnum):
    HELLO = 1  # worker -> engine, once: what it loaded, or why it could not
    COMMAND = 2  # engine -> worker: a step, a KV export, stop
    HIDDEN = 3  # stage -> next stage: the hidden states of a step
    LOGITS = 4  # last stage -> engine: the logit rows of a step
    KV = 5  # worker -> engine: its part of a KV export
    STATS = 6  # worker -> engine: how busy it has been


@dataclass
class Outbox:
    """Sends in progress and the buffers they read, kept alive until ``wait``."""

    works: list[Any] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)

    def add(self, group, tensor: torch.Tensor, dst: int, tag: Tag) -> None:
        self.buffers.append(tensor)
        self.works.append(group.send([tensor], dst, int(tag)))

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()
        self.buffers.clear()


def encode(obj: Any) -> tuple[torch.Tensor, torch.Tensor]:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.tensor([len(data)], dtype=torch.int64), torch.frombuffer(bytearray(data), dtype=torch.uint8)


def send_object(group, obj: Any, dst: int, tag: Tag, outbox: Outbox | None = None) -> Outbox:
    outbox = outbox if outbox is not None else Outbox()
    header, payload = encode(obj)
    outbox.add(group, header, dst, tag)
    outbox.add(group, payload, dst, tag)
    return outbox


def send_encoded(group, encoded: tuple[torch.Tensor, torch.Tensor], dst: int, tag: Tag, outbox: Outbox) -> None:
    """One pickled object to several receivers, encoded once."""
    for tensor in encoded:
        outbox.add(group, tensor, dst, tag)


def recv_object(group, src: int, tag: Tag) -> Any:
    header = torch.empty(1, dtype=torch.int64)
    group.recv([header], src, int(tag)).wait()
    payload = torch.empty(int(header[0]), dtype=torch.uint8)
    group.recv([payload], src, int(tag)).wait()
    return pickle.loads(payload.numpy().tobytes())


def recv_tensor(group, tensor: torch.Tensor, src: int, tag: Tag):
    """Post a receive into ``tensor``; ``.wait()`` the result before reading it."""
    return group.recv([tensor], src, int(tag))
