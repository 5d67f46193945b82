"""``tensor_parallel_size``, ``step_timeout_s``, ``worker_cpus`` and ``cpu_threads`` in the Serve config
(validated, consistent with the placement group, passed to the runner), and ``configs/smollm2-cpu-tp.yaml``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tr_serve.serve.config import ConfigError, TRServeConfig
from tr_serve.tp.placement import DEFAULT_GPU_WORKER_CPUS, DEFAULT_STEP_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


def test_default_is_one_process():
    assert TRServeConfig.from_args({}).tensor_parallel_size == 1


def test_bad_sizes_are_rejected_naming_the_key():
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        TRServeConfig.from_args({"tensor_parallel_size": 0})
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 needs at least 3 placement_group_bundles"):
        TRServeConfig.from_args({"tensor_parallel_size": 3, "placement_group_bundles": [{"CPU": 1}, {"CPU": 1}]})


def test_cpu_tp_yaml_reserves_the_replica_and_three_workers():
    config = yaml.safe_load((ROOT / "configs" / "smollm2-cpu-tp.yaml").read_text())
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8000}
    cfg = TRServeConfig.from_args(config["applications"][0]["args"])
    assert cfg.tensor_parallel_size == 3 and cfg.engine_kwargs.tree == "top4" and cfg.engine_kwargs.device == "cpu"
    opts = cfg.server_deployment_options()
    assert opts["placement_group_bundles"] == [{"CPU": 0.5}] * 4  # bundle 0: replica; 1..3: workers
    assert sum(b["CPU"] for b in opts["placement_group_bundles"]) <= 2  # schedulable on a 2-core machine
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"]["num_cpus"] == 0.5


GPU_TP2 = {"tensor_parallel_size": 2, "engine_kwargs": {"device": "cuda"}}


def test_step_timeout_is_configured_and_validated():
    assert TRServeConfig.from_args({}).step_timeout_s == DEFAULT_STEP_TIMEOUT_S == 60.0
    assert TRServeConfig.from_args({"step_timeout_s": 120}).step_timeout_s == 120.0
    for bad in (0, -1, "soon", float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="step_timeout_s"):
            TRServeConfig.from_args({"step_timeout_s": bad})
    with pytest.raises(ConfigError, match="init_timeout_s"):
        TRServeConfig.from_args({"init_timeout_s": float("inf")})


def test_gpu_worker_bundles_get_cpus_and_worker_cpus_must_fit():
    bundles = [{"CPU": 2}, {"GPU": 1}, {"GPU": 1}]
    opts = TRServeConfig.from_args({**GPU_TP2, "placement_group_bundles": bundles}).server_deployment_options()
    assert opts["placement_group_bundles"] == [{"CPU": 2}] + [{"GPU": 1, "CPU": DEFAULT_GPU_WORKER_CPUS}] * 2
    assert opts["ray_actor_options"] == {"num_gpus": 0, "num_cpus": 2}  # the replica: bundle 0, no GPU
    cfg = TRServeConfig.from_args({**GPU_TP2, "worker_cpus": 6, "placement_group_bundles": bundles})
    assert cfg.server_deployment_options()["placement_group_bundles"][1:] == [{"GPU": 1, "CPU": 6}] * 2
    explicit = [{"CPU": 2}, {"GPU": 1, "CPU": 2}, {"GPU": 1, "CPU": 8}]
    assert TRServeConfig.from_args({**GPU_TP2, "placement_group_bundles": explicit}).server_deployment_options()[
        "placement_group_bundles"] == explicit  # named CPUs are kept
    with pytest.raises(ConfigError, match=r"worker_cpus=4 does not fit placement_group_bundles\[1\]"):
        TRServeConfig.from_args({**GPU_TP2, "worker_cpus": 4, "placement_group_bundles": explicit})
    for bad in (0, -2, float("inf")):
        with pytest.raises(ConfigError, match="worker_cpus"):
            TRServeConfig.from_args({**GPU_TP2, "worker_cpus": bad})


def test_cpu_threads_follow_the_replicas_cpus():
    assert TRServeConfig.from_args({}).resolved_cpu_threads() is None  # no reservation named: torch's default
    assert TRServeConfig.from_args({"placement_group_bundles": [{"CPU": 3}]}).resolved_cpu_threads() == 3
    assert TRServeConfig.from_args({"placement_group_bundles": [{"CPU": 0.5}]}).resolved_cpu_threads() == 1
    assert TRServeConfig.from_args({"ray_actor_options": {"num_cpus": 6}, "placement_group_bundles": [{"CPU": 8}]}
                                   ).resolved_cpu_threads() == 6  # the actor's own share of bundle 0
    assert TRServeConfig.from_args({"cpu_threads": 2, "ray_actor_options": {"num_cpus": 2}}).resolved_cpu_threads() == 2
    assert TRServeConfig.from_args({"cpu_threads": 1, "ray_actor_options": {"num_cpus": 0.5}}).cpu_threads == 1
    assert TRServeConfig.from_args({"cpu_threads": 16}).cpu_threads == 16  # Serve's default reservation: not checked
    with pytest.raises(ConfigError, match=r"cpu_threads=4 exceeds the 1 CPU\(s\) the model replica reserves"):
        TRServeConfig.from_args({"cpu_threads": 4, "placement_group_bundles": [{"CPU": 1}, {"CPU": 1}]})
    with pytest.raises(ConfigError, match=r"cpu_threads=3 exceeds the 2 CPU"):
        TRServeConfig.from_args({"cpu_threads": 3, "ray_actor_options": {"num_cpus": 2}})


def test_llama70b_yaml_gives_every_gpu_worker_cpus_and_fits_the_pod():
    config = yaml.safe_load((ROOT / "configs" / "llama70b.yaml").read_text())
    cfg = TRServeConfig.from_args(config["applications"][0]["args"])
    bundles = cfg.server_deployment_options()["placement_group_bundles"]
    workers = bundles[-cfg.tensor_parallel_size:]
    assert all(b["GPU"] == 1 and b["CPU"] == cfg.worker_cpus > 1 for b in workers)
    assert cfg.resolved_cpu_threads() == cfg.cpu_threads == bundles[0]["CPU"] > 1
    assert cfg.step_timeout_s == DEFAULT_STEP_TIMEOUT_S
    manifest = yaml.safe_load((ROOT / "k8s" / "rayservice-llama70b.yaml").read_text())
    pod = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert sum(b.get("CPU", 0) for b in bundles) + 1 <= float(pod["resources"]["requests"]["cpu"])  # + the ingress


def test_server_passes_the_fields_to_the_tp_runner(monkeypatch):
    """``LLMServer`` builds its tensor-parallel engine with the config's worker CPUs and timeouts,
    and sets the replica's own threads."""
    import asyncio

    import torch

    from tr_serve.serve.server import LLMServer
    from tr_serve.tp import runner

    class Built(Exception):
        pass

    seen = {}

    def fake_tp_engine(model, config, tensor_parallel_size, **options):
        seen.update(options, tensor_parallel_size=tensor_parallel_size, threads=torch.get_num_threads())
        raise Built

    monkeypatch.setattr(runner, "tp_engine", fake_tp_engine)
    args = {**GPU_TP2, "engine_kwargs": {"device": "cpu"}, "step_timeout_s": 90, "init_timeout_s": 900,
            "worker_cpus": 0.5, "placement_group_bundles": [{"CPU": 2}, {"CPU": 0.5}, {"CPU": 0.5}]}
    threads = torch.get_num_threads()
    try:
        with pytest.raises(Built):  # a plain object as self: an LLMServer's (async) __del__ would go unawaited
            asyncio.run(LLMServer.__init__(SimpleNamespace(), args))
    finally:
        torch.set_num_threads(threads)
    assert seen == {"tensor_parallel_size": 2, "worker_cpus": 0.5, "step_timeout_s": 90.0, "init_timeout_s": 900.0,
                    "threads": 2}
