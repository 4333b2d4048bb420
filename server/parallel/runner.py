"""The engine's side of a parallel model: a ModelRunner whose model lives in worker processes.

``submit`` sends a scheduled step to every worker (as plain lists, step_inputs.StepPlan) and
returns at once; ``collect`` waits for the last stage's logit rows and samples them here, where
the sampler's per-request state lives. The engine keeps up to ``pipeline_depth`` steps
submitted (engine.py), so every stage has a batch to work on. KV transfer payloads keep the
single-process layout (every layer, every KV head): an export is gathered from the workers' parts
and an import is cut into them, so servers of any two layouts exchange KV.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp
from transformers import AutoConfig

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.batch import SchedulerOutput
from llmfleet.server.core.kv_wire import KVLayout
from llmfleet.server.core.request import SampledToken, StructuredOutput
from llmfleet.server.parallel.channel import Outbox, Tag, encode, recv_object, recv_tensor, send_encoded
from llmfleet.server.parallel.layout import ParallelLayout, layout_problem
from llmfleet.server.parallel.worker import WorkerSpec, meeting_store, run_worker, world_group
from llmfleet.server.runner import request_rope
from llmfleet.server.runner.grammar_masks import GrammarMasks
from llmfleet.server.runner.model_support import causal_lm_class
from llmfleet.server.runner.sampler import Sampler
from llmfleet.server.runner.step_inputs import plan_step
from llmfleet.server.runner.torch_runner import DTYPES, context_limit, imported_kv, resolve_device, step_results

log = logging.getLogger(__name__)

# An idle worker waits for its next command; a no-op every so often keeps that wait well within
# the group's timeout.
KEEPALIVE_SECONDS = 60.0


@dataclass
class Submitted:
    output: SchedulerOutput
    sample_index: list[int]
    prompt_spans: list[tuple[int, int]]
    logits: torch.Tensor | None
    received: object | None
    outbox: Outbox


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_threads(num_workers: int) -> int:
    """Threads per worker: ``LLMFLEET_WORKER_THREADS``, else this process's CPUs shared out."""
    given = os.environ.get("LLMFLEET_WORKER_THREADS")
    if given:
        return max(1, int(given))
    return max(1, len(os.sched_getaffinity(0)) // num_workers)


def start_workers(
    model_dir: str,
    config: EngineConfig,
    ranks: range,
    master_addr: str,
    master_port: int,
    device: str | None,
) -> list:
    """Spawn the worker processes of ``ranks`` on this node."""
    layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
    threads = worker_threads(len(ranks))
    context = mp.get_context("spawn")
    processes = []
    for index, rank in enumerate(ranks):
        spec = WorkerSpec(model_dir, config, layout, rank, master_addr, master_port, device, threads, index)
        process = context.Process(target=run_worker, args=(spec,), name=f"llmfleet-worker-{rank}", daemon=True)
        process.start()
        processes.append(process)
    return processes


def leave_cores_to_workers() -> None:
    """One torch thread for this process, which only samples: the workers own the cores, and idle
    OpenMP threads of this process would spin on them."""
    torch.set_num_threads(1)


def node_ranks(layout: ParallelLayout, nnodes: int, node_rank: int) -> range:
    """The worker ranks node ``node_rank`` of ``nnodes`` runs (the workers split evenly)."""
    if layout.num_workers % nnodes:
        raise ValueError(f"{layout.num_workers} workers do not split evenly over {nnodes} nodes")
    per_node = layout.num_workers // nnodes
    return range(1 + node_rank * per_node, 1 + (node_rank + 1) * per_node)


class ParallelRunner:
    def __init__(
        self,
        model_dir,
        config: EngineConfig,
        device: str | None = None,
        tokenizer=None,
        *,
        nnodes: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
    ) -> None:
        self.layout = layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
        hf_config = AutoConfig.from_pretrained(model_dir)
        problem = layout_problem(layout, hf_config)
        if problem:
            raise ValueError(problem)
        self.max_model_len = context_limit(config, hf_config)  # before any worker starts
        self.longrope_context = request_rope.longrope_context(hf_config.get_text_config())
        self.longrope_recomputes = request_rope.recomputes_past_context(causal_lm_class(hf_config))
        self.pipeline_depth = layout.pipeline
        self.device = resolve_device(device)  # the workers'; this process samples on the CPU
        self.device_type = self.device.type
        port = master_port or free_port()
        self._store = meeting_store(master_addr, port, master=True)  # kept as long as the workers run
        self._processes = start_workers(
            str(model_dir), config, node_ranks(layout, nnodes, 0), master_addr, port, device
        )
        self._world = world_group(self._store, 0, layout.world_size)
        self._lock = threading.Lock()  # one command at a time, header and payload together
        self._last_command = time.monotonic()
        self._closed = threading.Event()
        hellos = self._hellos()
        first, last = hellos[layout.rank(0, 0)], hellos[layout.rank(layout.pipeline - 1, 0)]
        self.dtype = DTYPES[first["dtype"]]
        self.kv_block_size = config.kv_block_size
        self.num_kv_blocks = min(h["num_kv_blocks"] for h in hellos.values())
        self.eos_token_ids = frozenset(first["eos_token_ids"])
        self.vocab_size = first["vocab_size"]
        self.logits_width = last["logits_width"]
        self._layers = {rank: range(*h["layers"]) for rank, h in hellos.items()}
        self.kv_layout = KVLayout(
            fingerprint=first["fingerprint"],
            dtype=first["dtype"],
            num_layers=first["num_layers"],
            num_kv_heads=first["num_kv_heads"],
            head_dim=first["head_dim"],
            block_size=self.kv_block_size,
        )
        grammars = None if tokenizer is None else GrammarMasks(tokenizer, self.logits_width, self.eos_token_ids)
        self.sampler = Sampler(torch.device("cpu"), self.eos_token_ids, grammars)
        threading.Thread(target=self._keepalive, name="llmfleet-worker-keepalive", daemon=True).start()
        log.info(
            "loaded %s over %d workers (tensor %d x pipeline %d), %d KV blocks of %d tokens",
            model_dir,
            layout.num_workers,
            layout.tensor,
            layout.pipeline,
            self.num_kv_blocks,
            self.kv_block_size,
        )

    def _hellos(self) -> dict[int, dict]:
        hellos = {}
        for rank in range(1, self.layout.world_size):
            hello = recv_object(self._world, rank, Tag.HELLO)
            if "error" in hello:
                self.close(wait=False)
                raise ValueError(f"model worker {rank} could not start: {hello['error']}")
            hellos[rank] = hello
        return hellos

    # --- ModelRunner ----------------------------------------------------------------------------
    @property
    def structured_output(self) -> bool:
        return self.sampler.grammars is not None

    def structured_problem(self, structured: StructuredOutput) -> str | None:
        grammars = self.sampler.grammars
        return "structured output is not available on this runner" if grammars is None else grammars.problem(structured)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def execute(self, output: SchedulerOutput) -> list[SampledToken | None]:
        return self.collect(self.submit(output)) if output.scheduled else []

    def submit(self, output: SchedulerOutput) -> Submitted:
        plan = plan_step(output, self.kv_block_size, self.device_type, rope_lengths=self.longrope_context is not None)
        rows = len(plan.logit_rows)
        logits = torch.empty((rows, self.logits_width), dtype=self.dtype) if rows else None
        received = None
        if logits is not None:
            received = recv_tensor(self._world, logits, self.layout.rank(self.layout.pipeline - 1, 0), Tag.LOGITS)
        imports = self._imports(output)
        outbox = Outbox()
        with self._lock:
            common = encode(("step", plan, [])) if not imports else None
            for rank in range(1, self.layout.world_size):
                encoded = common or encode(("step", plan, imports.get(rank, [])))
                send_encoded(self._world, encoded, rank, Tag.COMMAND, outbox)
            self._last_command = time.monotonic()
        return Submitted(output, plan.sample_index, plan.prompt_spans, logits, received, outbox)

    def collect(self, submitted: Submitted) -> list[SampledToken | None]:
        if submitted.received is not None:
            submitted.received.wait()
        submitted.outbox.wait()
        return step_results(
            self.sampler, submitted.output, submitted.sample_index, submitted.prompt_spans, submitted.logits
        )

    def export_kv(self, block_table: list[int], num_tokens: int) -> memoryview:
        layout = self.kv_layout
        blocks = block_table[: layout.num_blocks(num_tokens)]
        shape = layout.payload_shape(len(blocks))
        out = torch.empty(shape, dtype=self.dtype)
        heads = layout.num_kv_heads // self.layout.tensor
        parts = []
        for rank, layers in self._layers.items():
            _, shard = self.layout.position(rank)
            part = torch.empty((len(layers), *shape[1:2], heads, *shape[3:]), dtype=self.dtype)
            parts.append((part, layers, shard, recv_tensor(self._world, part, rank, Tag.KV)))
        self._command(("export", blocks))
        for part, layers, shard, received in parts:
            received.wait()
            out[layers.start : layers.stop, :, shard * heads : (shard + 1) * heads] = part
        return memoryview(out.view(torch.uint8).numpy()).cast("B")

    def _imports(self, output: SchedulerOutput) -> dict[int, list[tuple[list[int], torch.Tensor]]]:
        """Each worker's part of the KV imported by requests scheduled for the first time."""
        heads = self.kv_layout.num_kv_heads // self.layout.tensor
        parts: dict[int, list[tuple[list[int], torch.Tensor]]] = {}
        for blocks, data in imported_kv(output, self.kv_layout, self.dtype):
            for rank, layers in self._layers.items():
                _, shard = self.layout.position(rank)
                part = data[layers.start : layers.stop, :, shard * heads : (shard + 1) * heads].contiguous()
                parts.setdefault(rank, []).append((blocks, part))
        return parts

    def worker_stats(self) -> dict[int, dict]:
        """Each worker's busy seconds and steps so far (after the steps sent before)."""
        self._command(("stats",))
        return {rank: recv_object(self._world, rank, Tag.STATS) for rank in range(1, self.layout.world_size)}

    # --- the workers' lifetime ------------------------------------------------------------------
    def _command(self, command: tuple) -> None:
        outbox = Outbox()
        with self._lock:
            encoded = encode(command)
            for rank in range(1, self.layout.world_size):
                send_encoded(self._world, encoded, rank, Tag.COMMAND, outbox)
            self._last_command = time.monotonic()
        outbox.wait()

    def _keepalive(self) -> None:
        while not self._closed.wait(KEEPALIVE_SECONDS / 4):
            if time.monotonic() - self._last_command >= KEEPALIVE_SECONDS:
                try:
                    self._command(("noop",))
                except Exception:  # a worker gone: the next step reports it
                    log.exception("could not reach the model workers")
                    return

    def close(self, wait: bool = True) -> None:
        """Stop the workers (they finish the steps sent before)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if wait:
            try:
                self._command(("stop",))
            except Exception:
                log.exception("could not stop the model workers cleanly")
        for process in self._processes:
            process.join(timeout=10 if wait else 0)
            if process.is_alive():
                process.kill()
