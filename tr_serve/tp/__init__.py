"""Tensor parallelism: the replica's one ``Engine`` drives a ``TPModelRunner`` (``runner.py``) whose
``N`` Ray actor workers (``worker.py``) hold only their shard of the weights (heads and MLP columns,
``shard.py``; read slice by slice, ``loading.py``) and of the KV cache, and run the forwards."""

from tr_serve.tp.shard import ShardingError, check_shardable, shard_model

__all__ = ["ShardingError", "check_shardable", "shard_model", "TPModelRunner", "TPWorkerError", "tp_engine"]


def __getattr__(name):  # the runner imports ray: only when asked for
    if name in ("TPModelRunner", "TPWorkerError", "tp_engine"):
        from tr_serve.tp import runner

        return getattr(runner, name)
    raise AttributeError(name)
