"""Fleet-wide hot start: the replicas of one model share one Token Recycling adjacency matrix, and
the finished documents of their cross-request suffix indexes.

* :mod:`tr_serve.fleet.merge`        -- the pure merge rule (votes by rank, decayed by recency, top-K)
* :mod:`tr_serve.fleet.actor`        -- the matrix actor per (model id, namespace): merge, publish, persist
* :mod:`tr_serve.fleet.sync`         -- ``MatrixSync``: a replica's background push / poll / adopt
* :mod:`tr_serve.fleet.snapshot`     -- Arrow IPC snapshots on disk
* :mod:`tr_serve.fleet.corpus`       -- the suffix corpus: documents in columns, bounded, numbered
* :mod:`tr_serve.fleet.corpus_file`  -- the corpus's Arrow IPC snapshots on disk
* :mod:`tr_serve.fleet.suffix_share` -- a replica's side of the corpus: what it pushed, what it indexed
* :mod:`tr_serve.fleet.metrics`      -- ``tr_serve_matrix_*`` and ``tr_serve_suffix_*`` metrics
"""

from tr_serve.fleet.config import FleetSyncConfig

__all__ = ["FleetSyncConfig", "MatrixSync", "start_fleet_sync", "stop_matrix_actor"]


def __getattr__(name: str):  # the sync side imports torch; the config alone does not need it
    if name in ("MatrixSync", "start_fleet_sync"):
        from tr_serve.fleet import sync

        return getattr(sync, name)
    if name == "stop_matrix_actor":
        from tr_serve.fleet.actor import stop_matrix_actor

        return stop_matrix_actor
    raise AttributeError(name)
