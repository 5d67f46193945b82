"""Tensor parallelism: the model's heads and MLP columns split over N Ray actors, each running a
full ``Engine`` on its shard in lockstep (``TPEngine`` drives them; ``shard_model`` splits a
Llama-architecture model). See ``tr_serve/tp/shard.py`` for the layout and ``engine.py`` for the
execution and failure model."""

from tr_serve.tp.shard import ShardingError, check_shardable, shard_model

__all__ = ["ShardingError", "check_shardable", "shard_model", "TPEngine", "TPWorkerError"]


def __getattr__(name):  # TPEngine imports ray: only when asked for
    if name in ("TPEngine", "TPWorkerError"):
        from tr_serve.tp import engine

        return getattr(engine, name)
    raise AttributeError(name)
