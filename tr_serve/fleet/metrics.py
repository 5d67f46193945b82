"""Fleet sync metrics (``ray.util.metrics``: they work in the matrix actor and in Serve replicas).

Every metric carries ``model``, ``namespace`` and ``role`` (``actor`` or ``replica``); Ray adds
its own tags and exports them to Prometheus with a ``ray_`` prefix.

    tr_serve_matrix_version                    gauge      actor: current version; replica: adopted
    tr_serve_matrix_rows_merged                counter    actor: rows merged from pushes
    tr_serve_matrix_rows_pushed                counter    replica: rows sent to the actor
    tr_serve_matrix_push_latency_seconds       histogram  replica: one push round trip
    tr_serve_matrix_adopt_latency_seconds      histogram  replica: between-steps snapshot adoption
    tr_serve_matrix_snapshot_latency_seconds   histogram  actor: writing one disk snapshot
    tr_serve_matrix_snapshot_age_seconds       gauge      replica: age of the adopted snapshot
    tr_serve_matrix_sync_errors                counter    both, by ``kind``
    tr_serve_suffix_documents_shared           counter    actor: documents added to the suffix corpus;
                                                          replica: its finished documents the actor added
    tr_serve_suffix_documents_imported         counter    replica: fleet documents indexed in its suffix index

When Ray is not initialized (unit tests, offline tools) every metric is a no-op.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("tr_serve.fleet")

_TAGS = ("model", "namespace", "role")
_PUSH_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0]
_ADOPT_S = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1]
_SNAPSHOT_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class _Noop:
    def set(self, *a, **kw) -> None: ...
    def inc(self, *a, **kw) -> None: ...
    def observe(self, *a, **kw) -> None: ...


class FleetMetrics:
    def __init__(self, model_id: str, namespace: str, role: str):
        defaults = {"model": model_id, "namespace": namespace, "role": role}
        try:
            import ray
            from ray.util.metrics import Counter, Gauge, Histogram

            if not ray.is_initialized():
                raise RuntimeError("ray is not initialized")
            self.version = Gauge("tr_serve_matrix_version", description="Matrix version: the actor's current "
                                 "version, or the version a replica adopted.", tag_keys=_TAGS)
            self.rows_merged = Counter("tr_serve_matrix_rows_merged",
                                       description="Matrix rows merged by the actor from replica pushes.",
                                       tag_keys=_TAGS)
            self.rows_pushed = Counter("tr_serve_matrix_rows_pushed",
                                       description="Changed matrix rows a replica sent to the actor.", tag_keys=_TAGS)
            self.push_latency = Histogram("tr_serve_matrix_push_latency_seconds",
                                          description="Round trip of one replica push to the matrix actor.",
                                          boundaries=_PUSH_S, tag_keys=_TAGS)
            self.adopt_latency = Histogram("tr_serve_matrix_adopt_latency_seconds",
                                           description="Time between two engine steps spent adopting a fleet "
                                                       "snapshot (copy + reapplying own rows).",
                                           boundaries=_ADOPT_S, tag_keys=_TAGS)
            self.snapshot_latency = Histogram("tr_serve_matrix_snapshot_latency_seconds",
                                              description="Time to write one matrix snapshot to disk.",
                                              boundaries=_SNAPSHOT_S, tag_keys=_TAGS)
            self.snapshot_age = Gauge("tr_serve_matrix_snapshot_age_seconds",
                                      description="Seconds since the snapshot a replica runs on was published.",
                                      tag_keys=_TAGS)
            self.errors = Counter("tr_serve_matrix_sync_errors",
                                  description="Fleet sync failures by kind (actor unreachable, snapshot lost, "
                                              "disk, ...).", tag_keys=_TAGS + ("kind",))
            self.documents = Counter("tr_serve_suffix_documents_shared",
                                     description="Suffix-index documents added to the fleet's corpus (actor), or "
                                                 "a replica's finished documents the actor added (replica).",
                                     tag_keys=_TAGS)
            self.documents_imported = Counter("tr_serve_suffix_documents_imported",
                                              description="Documents of the fleet's suffix corpus a replica indexed.",
                                              tag_keys=_TAGS)
            for m in (self.version, self.rows_merged, self.rows_pushed, self.push_latency, self.adopt_latency,
                      self.snapshot_latency, self.snapshot_age, self.errors, self.documents, self.documents_imported):
                m.set_default_tags(defaults)
        except Exception as e:  # metrics never block syncing
            logger.debug("fleet metrics disabled: %s", e)
            noop = _Noop()
            self.version = self.rows_merged = self.rows_pushed = self.push_latency = noop
            self.adopt_latency = self.snapshot_latency = self.snapshot_age = self.errors = noop
            self.documents = self.documents_imported = noop

    def error(self, kind: str) -> None:
        try:
            self.errors.inc(1, tags={"kind": kind})
        except Exception:
            pass
