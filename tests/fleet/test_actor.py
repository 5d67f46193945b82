"""The matrix actor's address and spec (no Ray: the actor itself runs in tests/fleet/test_fleet_ray.py)."""

from __future__ import annotations

from tr_serve.fleet.actor import IDENTITY_KEYS, ActorAddress, actor_spec
from tr_serve.fleet.config import FleetSyncConfig
from tr_serve.fleet.snapshot import Identity


def test_one_address_per_model_and_fleet_namespace():
    assert ActorAddress.of("m").name == "tr_matrix:m:default"
    assert ActorAddress.of("m", None) == ActorAddress("m", "default")
    assert ActorAddress.of("/models/x", "tenant-1").name == "tr_matrix:/models/x:tenant-1"
    assert ActorAddress.ray_namespace == "tr_serve"


def test_spec_carries_the_identity_a_replica_must_match(tmp_path):
    spec = actor_spec(FleetSyncConfig(namespace="unit", snapshot_dir=str(tmp_path)), "m", 50, 4, "f" * 64)
    assert Identity(**{key: spec[key] for key in IDENTITY_KEYS}) == Identity("m", 50, 4, "f" * 64, "unit")
    assert spec["snapshot_folder"].startswith(str(tmp_path))
