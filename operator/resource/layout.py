"""Where one replica of a pool runs: T x S devices (tensor x pipeline parallel), on one pod or on
a group of pods, one per node.

A pool whose ``resources`` name a GPU (``nvidia.com/gpu``, or any ``<vendor>/gpu`` extended
resource) asks for that kind; the operator sets the count, in requests and limits alike. A
replica that fits on a node (T x S <= gpusPerNode) is one pod with T x S GPUs. One that does
not spans ceil(T x S / gpusPerNode) nodes, a LeaderWorkerSet group of pods with gpusPerNode GPUs
each: every node of the group must be full, or ranks would sit on a node's GPUs that no other
pod could use, so T x S must then be a multiple of gpusPerNode. A CPU pool (no GPU resource)
always runs a replica as one pod of T x S processes.

No spec or Kubernetes types here: spec.py checks a layout when it parses a spec, and the reconcile
pass renders it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_GPUS_PER_NODE = 8
GPU_RESOURCE = "nvidia.com/gpu"


class LayoutError(ValueError):
    """A parallel layout that cannot be placed: the message says why."""


@dataclass(frozen=True)
class Layout:
    """One replica's devices and pods."""

    tensor: int = 1
    pipeline: int = 1
    gpu_resource: str | None = None  # the extended resource the pods ask for; None: a CPU pool
    nodes: int = 1  # pods per replica: more than one is a LeaderWorkerSet group

    @property
    def devices(self) -> int:
        """Devices (GPUs, or CPU processes) one replica runs on: T x S."""
        return self.tensor * self.pipeline

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1

    @property
    def gpus_per_pod(self) -> int | None:
        """The GPU count of each pod, whatever count the resources wrote (a pod given more GPUs
        than its ranks would hold the rest idle); None for a CPU pool."""
        if self.gpu_resource is None:
            return None
        return self.devices // self.nodes


def gpu_resource(resources: Mapping[str, Any]) -> str | None:
    """The GPU resource a container's ``resources`` ask for (requests or limits), or None.
    Raises LayoutError where they name two kinds: which one the ranks run on is unclear."""
    names = {
        name
        for section in ("requests", "limits")
        for name in (resources.get(section) or {})
        if name == GPU_RESOURCE or name.endswith("/gpu")
    }
    if len(names) > 1:
        raise LayoutError(f"resources name several GPU kinds ({', '.join(sorted(names))}): keep one")
    return next(iter(names), None)


def layout(resources: Mapping[str, Any], tensor: int, pipeline: int, gpus_per_node: int) -> Layout:
    """The layout of a replica of T x S devices with these container resources. Raises LayoutError
    for a replica that spans nodes it does not fill."""
    gpu = gpu_resource(resources)
    devices = tensor * pipeline
    if gpu is None or devices <= gpus_per_node:
        return Layout(tensor, pipeline, gpu, 1)
    nodes = math.ceil(devices / gpus_per_node)
    if devices % gpus_per_node:
        raise LayoutError(
            f"tensor {tensor} x pipeline {pipeline} = {devices} GPUs span {nodes} nodes of {gpus_per_node} "
            f"GPUs (gpusPerNode) without filling them: a replica over several nodes takes whole nodes, "
            f"so use a multiple of {gpus_per_node} GPUs, or set gpusPerNode to what your nodes have"
        )
    return Layout(tensor, pipeline, gpu, nodes)


def with_gpu_count(resources: Mapping[str, Any], placed: Layout) -> dict[str, Any]:
    """``resources`` with the GPU count of each pod set in requests and limits (an extended
    resource must have both, equal). A single-GPU pool's are left as written where they already
    ask for one GPU in limits and in every section that names it: its pods render as they always
    have, and do not roll when the operator is upgraded."""
    out = {section: dict(value) for section, value in resources.items() if isinstance(value, Mapping)}
    out |= {section: value for section, value in resources.items() if not isinstance(value, Mapping)}
    count, gpu = placed.gpus_per_pod, placed.gpu_resource
    if count is None or gpu is None:
        return out
    written = [out[s][gpu] for s in ("requests", "limits") if gpu in out.get(s, {})]
    if placed.devices == 1 and gpu in out.get("limits", {}) and all(str(v).strip() == "1" for v in written):
        return out
    for section in ("requests", "limits"):
        out.setdefault(section, {})[gpu] = count
    return out
