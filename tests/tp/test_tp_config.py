"""``tensor_parallel_size`` in the Serve config, and ``configs/smollm2-cpu-tp.yaml``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tr_serve.serve.config import ConfigError, TRServeConfig

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
