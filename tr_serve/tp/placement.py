"""Where the tensor-parallel workers run: their CPUs, their GPU, and how they join one process group.

Everything here is pure (no Ray calls, no CUDA calls), so the placement rules are tested on a CPU
machine; ``TPModelRunner.__init__`` (``runner.py``) and ``TPWorker.place`` / ``setup``
(``worker.py``) make the thin Ray and CUDA calls around it.

GPUs, as vLLM's Ray executor and Ray Train place them: Ray gives an actor with ``num_gpus=1`` a
``CUDA_VISIBLE_DEVICES`` of its own GPU only, so every rank sees its GPU as ``cuda:0`` and NCCL sees
no peer GPU in the process's visible set; on NVSwitch nodes large all-reduces between such actors
have stalled (ray#61073, NVIDIA/nccl#1749). Instead every worker of a node gets the same
``CUDA_VISIBLE_DEVICES`` (the sorted GPU ids of all the group's workers on that node), selects its
own GPU with ``torch.cuda.set_device(local_rank)`` and passes ``device_id`` to
``init_process_group``, which makes NCCL create its communicator at start-up (eagerly, under
``init_timeout_s``) instead of inside the first forward (under ``step_timeout_s``, where a slow
communicator set-up would fail the replica and reload the model, in a loop).

CPUs: Ray sets ``OMP_NUM_THREADS`` of an actor to the CPUs it reserved (at least 1), so a GPU worker
that reserves none computes on one host thread. Each worker reserves ``worker_cpus`` in its own
placement-group bundle and runs that many torch threads (rounded down, at least 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, MutableMapping, Sequence

DEFAULT_STEP_TIMEOUT_S = 60.0  # one forward on every rank; a first forward no longer sets up NCCL
DEFAULT_INIT_TIMEOUT_S = 600.0  # placement, every rank reading its shard, the process group, the kernel plan
DEFAULT_CPU_WORKER_CPUS = 1.0  # a CPU rank computes on its CPUs: one each unless configured
# A GPU rank's host threads: the Python loop, host copies, tensor conversions while loading; four
# of a typical 8-GPU node's 64+ cores leave room for the replica and the ingress.
DEFAULT_GPU_WORKER_CPUS = 4.0
WARM_UP_ELEMENTS = 1024  # the start-up all-reduce: small; it only has to make the communicator exist


def torch_threads(cpus: float) -> int:
    """Torch threads for a reservation of ``cpus`` logical CPUs: Ray's ``OMP_NUM_THREADS`` rule
    (rounded down, at least 1), so a fractional share (0.5 CPU) still computes."""
    return max(1, math.floor(cpus))


def default_worker_cpus(cuda: bool) -> float:
    return DEFAULT_GPU_WORKER_CPUS if cuda else DEFAULT_CPU_WORKER_CPUS


def own_group_bundle(cuda: bool, worker_cpus: float | None) -> dict[str, float]:
    """One worker's bundle when the runner reserves a placement group of its own (no Serve group)."""
    cpus = worker_cpus if worker_cpus is not None else default_worker_cpus(cuda)
    return {"GPU": 1, "CPU": cpus} if cuda else {"CPU": cpus}


def worker_bundle_indices(num_bundles: int, tensor_parallel_size: int) -> range:
    """Indices of the workers' bundles: the last ``tensor_parallel_size`` ones (bundle 0 is the
    replica's, shared with rank 0 only when there are exactly ``tensor_parallel_size`` bundles)."""
    return range(num_bundles - tensor_parallel_size, num_bundles)


def with_worker_cpus(bundles: Sequence[Mapping[str, float]], tensor_parallel_size: int, cuda: bool,
                     worker_cpus: float | None) -> list[dict[str, float]]:
    """The Serve placement group's bundles with the workers' CPUs filled in: a worker bundle that
    names no ``CPU`` gets ``worker_cpus`` (default ``default_worker_cpus``), so a GPU bundle written
    as ``{GPU: 1}`` still gives its worker host threads. Raises ``ValueError`` where an explicit
    ``worker_cpus`` does not fit a bundle's ``CPU`` (the worker actor could never be placed there).

    Example (tp=2 on CUDA, default 4 CPUs a worker)::

        [{CPU: 2}, {GPU: 1}, {GPU: 1, CPU: 8}]  ->  [{CPU: 2}, {GPU: 1, CPU: 4}, {GPU: 1, CPU: 8}]
    """
    out = [dict(b) for b in bundles]
    if tensor_parallel_size < 2:
        return out
    for index in worker_bundle_indices(len(out), tensor_parallel_size):
        if index == 0:  # the replica's bundle: its CPUs are the replica's (cpu_threads)
            continue
        bundle = out[index]
        if "CPU" not in bundle:
            bundle["CPU"] = worker_cpus if worker_cpus is not None else default_worker_cpus(cuda)
        elif worker_cpus is not None and worker_cpus > bundle["CPU"]:
            raise ValueError(f"worker_cpus={worker_cpus:g} does not fit placement_group_bundles[{index}] "
                             f"{bundles[index]} of a tensor-parallel worker: raise its CPU or lower worker_cpus")
    return out


@dataclass(frozen=True)
class WorkerResources:
    """What one worker actor reserves in its bundle, and its torch threads."""

    num_cpus: float
    num_gpus: int
    threads: int


def worker_resources(bundle: Mapping[str, float], *, index: int, rank: int, cuda: bool,
                     worker_cpus: float | None = None, shared: bool = False,
                     threads: int | None = None) -> WorkerResources:
    """Rank ``rank``'s reservation in bundle ``index``: the bundle is the worker's own, so it takes
    ``worker_cpus`` (default: all of the bundle's CPUs) and one GPU on CUDA. ``shared``: bundle 0,
    where the replica already holds the CPUs, so the worker reserves none. ``threads`` overrides
    the torch threads (default: from the CPUs, ``torch_threads``)."""
    if cuda and bundle.get("GPU", 0) < 1:
        raise ValueError(f"bundle {index} {dict(bundle)} has no GPU for tensor-parallel rank {rank}")
    have = float(bundle.get("CPU", 0))
    if worker_cpus is not None and not shared and worker_cpus > have:
        raise ValueError(f"bundle {index} {dict(bundle)} has {have:g} CPU, tensor-parallel rank {rank} "
                         f"asks for worker_cpus={worker_cpus:g}")
    cpus = worker_cpus if worker_cpus is not None else have
    return WorkerResources(num_cpus=0.0 if shared else cpus, num_gpus=1 if cuda else 0,
                           threads=threads or torch_threads(cpus))


@dataclass(frozen=True)
class GPUPlacement:
    """One worker's view of its node's GPUs."""

    cuda_visible_devices: str  # e.g. "0,3,5": the GPUs of every worker of the group on this node, sorted
    local_rank: int  # this worker's own GPU's index in that list: torch.cuda.set_device(local_rank)

    @property
    def visible_count(self) -> int:
        return len(self.cuda_visible_devices.split(","))


def _gpu_id_key(gpu_id: str) -> tuple[int, int, str]:
    """Numeric ids in numeric order ("2" before "10"); UUIDs (``GPU-...``) after, by text."""
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)


def gpu_placements(workers: Sequence[tuple[str, Sequence[str | int]]]) -> list[GPUPlacement]:
    """Per worker (in rank order) its ``CUDA_VISIBLE_DEVICES`` and local rank, from each worker's
    (Ray node id, the GPU ids Ray gave it: ``ray.get_runtime_context().get_accelerator_ids()["GPU"]``).

    The node's workers share one ``CUDA_VISIBLE_DEVICES``, the sorted union of their GPU ids, and
    each one's local rank is the position of its own GPU there. Example, ranks 0-3 on two nodes::

        [("node-a", ["3"]), ("node-a", ["1"]), ("node-b", ["0"]), ("node-b", ["2"])]
        -> [GPUPlacement("1,3", 1), GPUPlacement("1,3", 0), GPUPlacement("0,2", 0), GPUPlacement("0,2", 1)]

    Raises ``ValueError`` when a worker holds no GPU or more than one (each rank drives exactly one
    GPU), or when two workers of a node report the same GPU.
    """
    owned: list[tuple[str, str]] = []
    for rank, (node, ids) in enumerate(workers):
        ids = [str(i) for i in ids]
        if len(ids) != 1:
            raise ValueError(f"tensor-parallel rank {rank} on node {node} holds GPU ids {ids}: every rank needs "
                             "exactly one GPU (num_gpus=1)")
        owned.append((node, ids[0]))
    by_node: dict[str, list[str]] = {}
    for rank, (node, gpu) in enumerate(owned):
        node_gpus = by_node.setdefault(node, [])
        if gpu in node_gpus:
            other = owned.index((node, gpu))
            raise ValueError(f"tensor-parallel ranks {other} and {rank} on node {node} both hold GPU {gpu}")
        node_gpus.append(gpu)
    visible = {node: sorted(gpus, key=_gpu_id_key) for node, gpus in by_node.items()}
    return [GPUPlacement(",".join(visible[node]), visible[node].index(gpu)) for node, gpu in owned]


def apply_gpu_placement(placement: GPUPlacement, environ: MutableMapping[str, str], *,
                        cuda_initialized: bool) -> None:
    """Set ``CUDA_VISIBLE_DEVICES`` for ``placement``. The CUDA runtime reads it once, when CUDA
    initialises: set after that it would be ignored (every rank would keep seeing only its own
    GPU), so that raises."""
    if cuda_initialized:
        raise RuntimeError("CUDA is already initialised in this worker: CUDA_VISIBLE_DEVICES="
                           f"{placement.cuda_visible_devices} would be ignored; place the worker before any CUDA call")
    environ["CUDA_VISIBLE_DEVICES"] = placement.cuda_visible_devices


def process_group_options(backend: str, init_method: str, rank: int, world_size: int, timeout_s: float,
                          local_rank: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``torch.distributed.init_process_group``. NCCL gets ``device_id`` (the
    worker's GPU, ``local_rank``): the communicator is created inside ``init_process_group``, not
    lazily by the first collective. gloo (CPU) gets none."""
    options: dict[str, Any] = {"backend": backend, "init_method": init_method, "rank": rank,
                               "world_size": world_size, "timeout": timedelta(seconds=timeout_s)}
    if backend == "nccl":
        if local_rank is None:
            raise ValueError("NCCL needs the worker's local rank (TPWorker.place before setup)")
        import torch

        options["device_id"] = torch.device("cuda", local_rank)
    return options


__all__ = ["DEFAULT_CPU_WORKER_CPUS", "DEFAULT_GPU_WORKER_CPUS", "DEFAULT_INIT_TIMEOUT_S", "DEFAULT_STEP_TIMEOUT_S",
           "GPUPlacement", "WARM_UP_ELEMENTS", "WorkerResources", "apply_gpu_placement", "default_worker_cpus",
           "gpu_placements", "own_group_bundle", "process_group_options", "torch_threads", "with_worker_cpus",
           "worker_bundle_indices", "worker_resources"]
