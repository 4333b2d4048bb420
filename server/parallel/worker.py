"""A model worker: one pipeline stage's layers, one tensor shard of them, and their KV cache.

It loads the model as the single-process runner does (from_pretrained with llm-fleet's
attention), cuts it to its part (sharding.py), says hello to the engine, then runs the commands
the engine sends, in order: a step takes the previous stage's hidden states (or the token ids on
the first stage), runs its layers, and hands the result on, to the next stage or, from the last,
the logit rows to the engine. Batches follow each other through the stages, so while this stage
runs batch b+1 the next one runs batch b.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmfleet.server.config import EngineConfig
from llmfleet.server.gc_heap import freeze_startup_heap
from llmfleet.server.parallel import shared_sum
from llmfleet.server.parallel.channel import Outbox, Tag, recv_object, send_object
from llmfleet.server.parallel.layout import ParallelLayout, layout_problem
from llmfleet.server.parallel.sharding import AllReduce, keep_stage, shard_layers
from llmfleet.server.runner import cpu_kernels, model_prep, request_rope
from llmfleet.server.runner.host_memory import keep_freed_host_memory
from llmfleet.server.runner.kv_cache import PagedKVCache
from llmfleet.server.runner.step_inputs import StepPlan
from llmfleet.server.runner.step_shapes import pads_steps
from llmfleet.server.runner.torch_runner import (
    DTYPE_NAMES,
    load_model,
    model_eos_ids,
    model_fingerprint,
    padded_inputs,
    resolve_device,
    resolve_dtype,
)

log = logging.getLogger(__name__)

# A wait longer than this on a peer is a failure. The engine keeps idle workers' command waits
# far shorter than this with a no-op command (runner.py).
GROUP_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class WorkerSpec:
    model_dir: str
    config: EngineConfig
    layout: ParallelLayout
    rank: int
    master_addr: str
    master_port: int
    device: str | None = None
    threads: int = 1
    local_index: int = 0  # among this node's workers: its GPU


def meeting_store(addr: str, port: int, *, master: bool = False):
    """The store the engine (its master) and the workers meet through."""
    return dist.TCPStore(addr, port, None, master, timeout=GROUP_TIMEOUT, wait_for_workers=False)


def world_group(store, rank: int, size: int):
    """The group of the engine and every worker: commands, hidden states, logits. Creating it
    waits for every rank."""
    return dist.ProcessGroupGloo(store, rank, size, GROUP_TIMEOUT)


def shard_all_reduce(store, layout: ParallelLayout, stage: int, shard: int, device: torch.device) -> AllReduce:
    """How a stage's tensor shards sum their partial products: NCCL between GPUs, shared memory
    between CPU processes that can map one file (shared_sum.py), else gloo."""
    prefixed = dist.PrefixStore(f"stage-{stage}", store)
    if device.type == "cuda":
        return functools.partial(dist.all_reduce, group=dist.ProcessGroupNCCL(prefixed, shard, layout.tensor))
    shared = shared_sum.join(prefixed, shard, layout.tensor) if device.type == "cpu" else None
    if shared is not None:
        return shared.all_reduce
    gloo = dist.ProcessGroupGloo(prefixed, shard, layout.tensor, GROUP_TIMEOUT)
    return functools.partial(dist.all_reduce, group=gloo)


def run_worker(spec: WorkerSpec) -> None:
    """A worker process's entry point: serve until the engine says stop or goes away."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker {spec.rank} %(levelname)s %(message)s")
    torch.set_num_threads(spec.threads)
    store = meeting_store(spec.master_addr, spec.master_port)
    world = world_group(store, spec.rank, spec.layout.world_size)
    try:
        worker = StageWorker(spec, store)
    except Exception as exc:
        log.exception("could not load the model")
        send_object(world, {"error": f"{type(exc).__name__}: {exc}"}, 0, Tag.HELLO).wait()
        return
    send_object(world, worker.hello, 0, Tag.HELLO).wait()
    freeze_startup_heap()  # a full collection here stalls every stage's step, as in the server
    try:
        worker.serve(world)
    except Exception:
        log.exception("worker failed; exiting")
        os._exit(1)  # the engine sees the connection close


class StageWorker:
    def __init__(self, spec: WorkerSpec, store) -> None:
        config, layout = spec.config, spec.layout
        self.layout = layout
        self.rank = spec.rank
        self.stage, self.shard = layout.position(spec.rank)
        self.first = self.stage == 0
        self.last = self.stage == layout.pipeline - 1
        device = resolve_device(spec.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", spec.local_index)
        self.device = device
        self.shards = shard_all_reduce(store, layout, self.stage, self.shard, device) if layout.tensor > 1 else None
        self.dtype = resolve_dtype(config.dtype, device)
        model, _ = load_model(spec.model_dir, self.dtype, device)  # the split models' configs say their shapes
        hf = model.config
        problem = layout_problem(layout, hf)
        if problem:
            raise ValueError(problem)
        fingerprint = model_fingerprint(model)
        eos = model_eos_ids(model)
        vocab = model.get_input_embeddings().num_embeddings
        logits_width = model.get_output_embeddings().weight.shape[0]
        self.hidden_size = hf.hidden_size
        layers = layout.stage_layers(hf.num_hidden_layers, self.stage)
        keep_stage(model, layers, self.first, self.last)
        if self.shards is not None:
            shard_layers(model, self.shard, layout.tensor, self.shards)
        packed = model_prep.prepare(model, device, self.dtype, config.max_num_batched_tokens)
        self.pad_steps = pads_steps(device.type, DTYPE_NAMES[self.dtype], packed)
        self.model = model
        kv_heads = (getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads) // layout.tensor
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        # every worker sizes the cache for the largest stage, so all hold the same blocks
        per_block = PagedKVCache.bytes_per_block(
            layout.max_stage_layers(hf.num_hidden_layers), config.kv_block_size, kv_heads, head_dim, itemsize
        )
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_mb * (1 << 20) // per_block)
        self.cache = PagedKVCache(
            hf.num_hidden_layers, num_blocks, config.kv_block_size, kv_heads, head_dim, self.dtype, device, layers
        )
        if device.type == "cpu":
            keep_freed_host_memory()
            if cpu_kernels.enabled():
                cpu_kernels.built()
        self._sends: deque[Outbox] = deque()
        self.busy_seconds = 0.0  # computing steps, not waiting for the previous stage
        self.steps = 0
        self.hello = {
            "fingerprint": fingerprint,
            "dtype": DTYPE_NAMES[self.dtype],
            "eos_token_ids": sorted(eos),
            "vocab_size": vocab,
            "logits_width": logits_width,
            "num_layers": hf.num_hidden_layers,
            "num_kv_heads": kv_heads * layout.tensor,
            "head_dim": head_dim,
            "num_kv_blocks": num_blocks,
            "layers": (layers.start, layers.stop),
            "device": str(device),
        }

    def serve(self, world) -> None:
        while True:
            command = recv_object(world, 0, Tag.COMMAND)
            kind = command[0]
            if kind == "step":
                self._step(world, command[1], command[2])
            elif kind == "export":
                self._export(world, command[1])
            elif kind == "stats":
                self._sends.append(
                    send_object(world, {"busy_seconds": self.busy_seconds, "steps": self.steps}, 0, Tag.STATS)
                )
            elif kind == "stop":
                break
            # "noop": the engine keeps an idle worker's wait short
        for outbox in self._sends:
            outbox.wait()

    def _send(self, world, tensor: torch.Tensor, dst: int, tag: Tag) -> None:
        """Send without waiting for the receiver; at most a few sends stay outstanding."""
        outbox = Outbox()
        outbox.add(world, tensor.cpu() if tensor.device.type != "cpu" else tensor, dst, tag)
        self._sends.append(outbox)
        while len(self._sends) > self.layout.pipeline + 1:
            self._sends.popleft().wait()

    @torch.inference_mode()
    def _step(self, world, plan: StepPlan, imports: list[tuple[list[int], torch.Tensor]]) -> None:
        for blocks, data in imports:
            self.cache.import_blocks(blocks, data)
        step = plan.to_inputs(self.cache, self.device)
        ids, positions = padded_inputs(step) if self.pad_steps else (step.input_ids, step.positions)
        if self.first:
            inputs = {"input_ids": ids}
        else:
            hidden = torch.empty((1, positions.shape[1], self.hidden_size), dtype=self.dtype)
            world.recv([hidden], self.layout.rank(self.stage - 1, self.shard), int(Tag.HIDDEN)).wait()
            inputs = {"inputs_embeds": hidden.to(self.device)}
        started = time.perf_counter()
        common = {"position_ids": positions, "use_cache": False, "llmfleet_meta": step.meta}
        if self.last:
            with request_rope.step_lengths(step.meta.rope_lengths):
                logits = self.model(**inputs, **common, logits_to_keep=step.logit_rows).logits[0].contiguous()
            self._count(started)
            if self.shard == 0 and logits.shape[0]:  # a step of mid-prompt chunks samples nothing
                self._send(world, logits, 0, Tag.LOGITS)
        else:
            with request_rope.step_lengths(step.meta.rope_lengths):
                hidden = self.model.model(**inputs, **common).last_hidden_state.contiguous()
            self._count(started)
            self._send(world, hidden, self.layout.rank(self.stage + 1, self.shard), Tag.HIDDEN)

    def _count(self, started: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.busy_seconds += time.perf_counter() - started
        self.steps += 1

    def _export(self, world, blocks: list[int]) -> None:
        self._send(world, self.cache.export_blocks(blocks), 0, Tag.KV)
