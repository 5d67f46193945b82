"""Where tensor-parallel workers run (``tr_serve/tp/placement.py``): the GPU mapping of vLLM and Ray
Train (a node's workers share ``CUDA_VISIBLE_DEVICES``, each selects its own GPU by local rank) from
a fake Ray runtime context, the worker's thin CUDA calls against fakes, the process-group arguments
(NCCL gets ``device_id``, gloo nothing), the workers' CPUs and threads; then, on a local Ray
instance with logical GPUs, the real runtime context: Ray's per-actor ``CUDA_VISIBLE_DEVICES`` is
replaced by the node's, and a CUDA runner gets as far as selecting the GPU in every rank."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

from tr_serve.tp.placement import (DEFAULT_GPU_WORKER_CPUS, GPUPlacement, gpu_placements, own_group_bundle,
                                   process_group_options, torch_threads, with_worker_cpus, worker_resources)
from tr_serve.tp.worker import TPWorker


class FakeRuntimeContext:
    """What ``TPWorker.placement_info`` reads of ``ray.get_runtime_context()`` in an actor."""

    def __init__(self, node_id: str, gpu_ids: list[str]):
        self.node_id, self.gpu_ids = node_id, gpu_ids

    def get_node_id(self) -> str:
        return self.node_id

    def get_accelerator_ids(self) -> dict[str, list[str]]:
        return {"GPU": list(self.gpu_ids), "TPU": []}


def place_workers(monkeypatch, actors: list[tuple[str, list[str]]]) -> list[tuple[TPWorker, str]]:
    """Per rank a ``TPWorker`` run as Ray would: its runtime context says (node, GPU ids) and Ray set
    ``CUDA_VISIBLE_DEVICES`` to its own GPU; the runner's mapping is applied with ``place``. Returns
    (worker, the CUDA_VISIBLE_DEVICES it sees afterwards) per rank."""
    import ray

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    workers = [TPWorker(rank, len(actors)) for rank in range(len(actors))]
    infos = []
    for worker, (node, ids) in zip(workers, actors):
        monkeypatch.setattr(ray, "get_runtime_context", lambda node=node, ids=ids: FakeRuntimeContext(node, ids))
        infos.append(worker.placement_info())
    assert infos == [(node, ids) for node, ids in actors]
    out = []
    for worker, placement, (_, ids) in zip(workers, gpu_placements(infos), actors):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(ids))  # what Ray gives each actor
        worker.place(placement)
        out.append((worker, os.environ["CUDA_VISIBLE_DEVICES"]))
    return out


def nccl_device(worker: TPWorker) -> torch.device:
    return process_group_options("nccl", "tcp://127.0.0.1:1", worker.rank, worker.world_size, 30.0,
                                 worker.placement.local_rank)["device_id"]


def test_one_node_eight_gpus_given_out_of_order(monkeypatch):
    ids = ["5", "0", "7", "2", "3", "6", "1", "4"]  # rank r holds GPU ids[r]
    placed = place_workers(monkeypatch, [("node-a", [i]) for i in ids])
    for (worker, visible), gpu in zip(placed, ids):
        assert visible == "0,1,2,3,4,5,6,7"  # every rank sees the node's 8 GPUs, in id order
        assert worker.placement.local_rank == int(gpu)  # and selects its own
        assert nccl_device(worker) == torch.device("cuda", int(gpu))


def test_two_nodes_of_four_gpus(monkeypatch):
    actors = [("node-a", ["6"]), ("node-a", ["4"]), ("node-b", ["1"]), ("node-a", ["7"]),
              ("node-b", ["3"]), ("node-b", ["0"]), ("node-a", ["5"]), ("node-b", ["2"])]
    placed = place_workers(monkeypatch, actors)
    want = {"node-a": "4,5,6,7", "node-b": "0,1,2,3"}
    for (worker, visible), (node, (gpu,)) in zip(placed, actors):
        assert visible == want[node]
        assert visible.split(",")[worker.placement.local_rank] == gpu
    assert [w.placement.local_rank for w, _ in placed] == [2, 0, 1, 3, 3, 0, 1, 2]
    assert [nccl_device(w).index for w, _ in placed] == [2, 0, 1, 3, 3, 0, 1, 2]


def test_ids_sort_as_numbers_and_uuids_after():
    assert gpu_placements([("n", ["10"]), ("n", ["9"]), ("n", [2])]) == [
        GPUPlacement("2,9,10", 2), GPUPlacement("2,9,10", 1), GPUPlacement("2,9,10", 0)]
    uuids = [("n", ["GPU-b2"]), ("n", ["GPU-a1"])]
    assert [p.local_rank for p in gpu_placements(uuids)] == [1, 0]
    assert gpu_placements(uuids)[0].cuda_visible_devices == "GPU-a1,GPU-b2"


def test_docstring_example():
    got = gpu_placements([("node-a", ["3"]), ("node-a", ["1"]), ("node-b", ["0"]), ("node-b", ["2"])])
    assert got == [GPUPlacement("1,3", 1), GPUPlacement("1,3", 0), GPUPlacement("0,2", 0), GPUPlacement("0,2", 1)]


@pytest.mark.parametrize("actors, message", [
    ([("a", ["0"]), ("a", ["1", "2"])], r"rank 1 on node a holds GPU ids \['1', '2'\]"),
    ([("a", ["0"]), ("a", [])], r"rank 1 on node a holds GPU ids \[\]"),
    ([("a", ["3"]), ("b", ["3"]), ("a", ["3"])], r"ranks 0 and 2 on node a both hold GPU 3"),
])
def test_a_mismatch_is_refused_naming_the_rank(monkeypatch, actors, message):
    import ray

    infos = []
    for node, ids in actors:  # through the worker's reading of the runtime context, as the runner gets them
        monkeypatch.setattr(ray, "get_runtime_context", lambda node=node, ids=ids: FakeRuntimeContext(node, ids))
        infos.append(TPWorker(len(infos), len(actors)).placement_info())
    with pytest.raises(ValueError, match=message):
        gpu_placements(infos)


def test_place_refuses_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    worker = TPWorker(0, 2)
    with pytest.raises(RuntimeError, match="already initialised"):
        worker.place(GPUPlacement("1,3", 1))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and worker.placement is None


def test_setup_selects_the_placed_gpu(monkeypatch):
    """The thin CUDA calls of ``TPWorker.setup``: ``set_device(local_rank)`` once the node's GPUs are
    visible; refused before ``place`` and when CUDA sees another number of GPUs than placed."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    worker = TPWorker(1, 2)
    with pytest.raises(RuntimeError, match="was not placed"):
        worker._select_gpu()
    worker.placement = GPUPlacement("0,1,2,3", 2)
    assert worker._select_gpu() == 2 and calls == [2]
    worker.placement = GPUPlacement("0,1", 1)  # e.g. CUDA initialised before the variable was set
    with pytest.raises(RuntimeError, match=r"sees 4 GPU\(s\), CUDA_VISIBLE_DEVICES=0,1 names 2"):
        worker._select_gpu()
    assert calls == [2]


def test_process_group_arguments():
    nccl = process_group_options("nccl", "tcp://10.0.0.1:29500", 3, 8, 1800.0, local_rank=5)
    assert nccl == {"backend": "nccl", "init_method": "tcp://10.0.0.1:29500", "rank": 3, "world_size": 8,
                    "timeout": timedelta(seconds=1800), "device_id": torch.device("cuda", 5)}
    gloo = process_group_options("gloo", "tcp://127.0.0.1:29500", 1, 2, 600.0, local_rank=None)
    assert gloo == {"backend": "gloo", "init_method": "tcp://127.0.0.1:29500", "rank": 1, "world_size": 2,
                    "timeout": timedelta(seconds=600)}  # no device_id on CPU
    assert "device_id" not in process_group_options("gloo", "tcp://x:1", 0, 2, 60.0, local_rank=0)
    with pytest.raises(ValueError, match="local rank"):
        process_group_options("nccl", "tcp://x:1", 0, 2, 60.0)


def test_worker_cpus_and_threads():
    assert [torch_threads(c) for c in (0, 0.5, 1, 3.9, 4)] == [1, 1, 1, 3, 4]
    # a GPU worker takes its bundle's CPUs and runs that many threads (not Ray's 1 for num_cpus=0)
    assert worker_resources({"GPU": 1, "CPU": 4}, index=1, rank=0, cuda=True) == (
        worker_resources({"GPU": 1, "CPU": 4}, index=1, rank=0, cuda=True, worker_cpus=4))
    res = worker_resources({"GPU": 1, "CPU": 4}, index=1, rank=0, cuda=True)
    assert (res.num_cpus, res.num_gpus, res.threads) == (4, 1, 4)
    res = worker_resources({"GPU": 1, "CPU": 8}, index=2, rank=1, cuda=True, worker_cpus=2)
    assert (res.num_cpus, res.threads) == (2, 2)
    res = worker_resources({"CPU": 0.5}, index=3, rank=2, cuda=False)
    assert (res.num_cpus, res.num_gpus, res.threads) == (0.5, 0, 1)
    res = worker_resources({"CPU": 2}, index=0, rank=0, cuda=False, shared=True)  # the replica holds bundle 0's CPUs
    assert (res.num_cpus, res.threads) == (0, 2)
    assert worker_resources({"CPU": 2}, index=1, rank=0, cuda=False, threads=1).threads == 1
    with pytest.raises(ValueError, match=r"bundle 2 \{'GPU': 1, 'CPU': 2\} has 2 CPU, tensor-parallel rank 1"):
        worker_resources({"GPU": 1, "CPU": 2}, index=2, rank=1, cuda=True, worker_cpus=4)
    with pytest.raises(ValueError, match="has no GPU for tensor-parallel rank 0"):
        worker_resources({"CPU": 4}, index=1, rank=0, cuda=True)
    assert own_group_bundle(True, None) == {"GPU": 1, "CPU": DEFAULT_GPU_WORKER_CPUS}
    assert own_group_bundle(False, None) == {"CPU": 1} and own_group_bundle(False, 0.5) == {"CPU": 0.5}


def test_worker_bundles_get_cpus_where_they_name_none():
    bundles = [{"CPU": 2}, {"GPU": 1}, {"GPU": 1, "CPU": 8}]
    assert with_worker_cpus(bundles, 2, True, None) == [{"CPU": 2}, {"GPU": 1, "CPU": DEFAULT_GPU_WORKER_CPUS},
                                                        {"GPU": 1, "CPU": 8}]
    assert with_worker_cpus(bundles, 2, True, 3) == [{"CPU": 2}, {"GPU": 1, "CPU": 3}, {"GPU": 1, "CPU": 8}]
    assert bundles[1] == {"GPU": 1}  # the config's own list is left alone
    # bundle 0 is the replica's, even where rank 0 shares it: its CPUs are the replica's to name
    assert with_worker_cpus([{"GPU": 1}, {"GPU": 1}], 2, True, None) == [{"GPU": 1}, {"GPU": 1, "CPU": 4}]
    assert with_worker_cpus([{"GPU": 1}] * 2, 1, True, None) == [{"GPU": 1}] * 2  # no tensor parallelism: untouched
    with pytest.raises(ValueError, match=r"worker_cpus=9 does not fit placement_group_bundles\[2\]"):
        with_worker_cpus(bundles, 2, True, 9)


# ---- the real Ray runtime context (logical GPUs: Ray hands out ids without any device) ----------

@pytest.fixture(scope="module")
def ray_gpus():
    import ray

    ray.init(address="local", num_cpus=3, num_gpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_ray_actors_see_their_nodes_gpus_after_place(ray_gpus):
    ray = ray_gpus
    actor = ray.remote(TPWorker).options(num_gpus=1, num_cpus=0.5)
    workers = [actor.remote(rank, 3) for rank in range(3)]
    try:
        before = ray.get([w.call.remote(lambda w: os.environ.get("CUDA_VISIBLE_DEVICES")) for w in workers])
        infos = ray.get([w.placement_info.remote() for w in workers])
        assert before == [ids[0] for _, ids in infos]  # Ray's default: each actor sees its own GPU only
        assert len({node for node, _ in infos}) == 1 and len({ids[0] for _, ids in infos}) == 3
        placements = gpu_placements(infos)
        ray.get([w.place.remote(p) for w, p in zip(workers, placements)])
        after = ray.get([w.call.remote(lambda w: (os.environ["CUDA_VISIBLE_DEVICES"], w.placement.local_rank))
                         for w in workers])
        visible = ",".join(sorted((ids[0] for _, ids in infos), key=int))
        assert [v for v, _ in after] == [visible] * 3
        assert [visible.split(",")[r] for _, r in after] == [ids[0] for _, ids in infos]
    finally:
        for w in workers:
            ray.kill(w)


def test_cuda_runner_places_every_rank_before_setup(ray_gpus, tokenizer):
    """A CUDA runner on logical GPUs: every rank is placed (node's ids, its local rank) and ``setup``
    reaches its first CUDA call, where a machine without CUDA stops it, at start-up, naming the
    placement; the runner's own group reserves CPUs beside each GPU."""
    from tp_testutil import tiny

    from tr_serve.engine.config import EngineConfig
    from tr_serve.tp.runner import TPModelRunner, TPWorkerError

    config = EngineConfig(tree="top4", max_num_seqs=2, max_model_len=64, device="cuda", dtype="float32")
    with pytest.raises(TPWorkerError, match=r"(?s)failed in start-up: .*RuntimeError: tensor-parallel rank \d sees 0 "
                                            r"GPU\(s\), CUDA_VISIBLE_DEVICES=\d,\d names 2"):
        TPModelRunner(tiny(tokenizer, "tiny-placement"), config, 2, worker_cpus=1, init_timeout_s=120)
    deadline = time.monotonic() + 30
    while ray_gpus.available_resources().get("GPU") != 4:  # the runner removed its own group (asynchronously)
        assert time.monotonic() < deadline, ray_gpus.available_resources()
        time.sleep(0.2)
