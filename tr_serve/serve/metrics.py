"""Ray Serve metrics of the HTTP API and the engine (documented in docs/serving.md, "Metrics").

Ray exports them to Prometheus with a ``ray_`` prefix and adds the ``deployment``, ``replica`` and
``application`` tags; every metric here also carries ``model`` (the served model id).
"""

from __future__ import annotations

import threading

from ray.serve.metrics import Counter, Gauge, Histogram

_LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
_TOKEN_LATENCY_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
_ACCEPTED = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16]
_NODES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 192, 256]


class IngressMetrics:
    def __init__(self) -> None:
        self.requests = Counter(
            "tr_serve_requests",
            description="HTTP API requests by endpoint, model and final status code "
                        "(499 = client disconnected mid-stream).",
            tag_keys=("model", "endpoint", "status"),
        )

    def request(self, model: str, endpoint: str, status: int | str) -> None:
        self.requests.inc(1, tags={"model": model, "endpoint": endpoint, "status": str(status)})


class ServerMetrics:
    """Request-level metrics (asyncio side) and engine gauges (``on_step``, engine thread)."""

    def __init__(self, model_id: str) -> None:
        tags = ("model",)
        self.ttft = Histogram("tr_serve_time_to_first_token_seconds",
                              description="Time from the request reaching the model server to its first token.",
                              boundaries=_LATENCY_S, tag_keys=tags)
        self.tpot = Histogram("tr_serve_time_per_output_token_seconds",
                              description="Per request: (last token time - first token time) / (tokens - 1).",
                              boundaries=_TOKEN_LATENCY_S, tag_keys=tags)
        self.e2e = Histogram("tr_serve_request_latency_seconds",
                             description="Time from the request reaching the model server to its last token.",
                             boundaries=_LATENCY_S, tag_keys=tags)
        self.prompt_tokens = Counter("tr_serve_prompt_tokens", description="Prompt tokens of served requests.",
                                     tag_keys=tags)
        self.generated_tokens = Counter("tr_serve_generated_tokens", description="Generated (output) tokens.",
                                        tag_keys=tags)
        self.finished = Counter("tr_serve_requests_finished",
                                description="Requests the engine finished, by finish_reason (stop, length, abort).",
                                tag_keys=("model", "finish_reason"))
        self.accepted = Histogram("tr_serve_accepted_tokens_per_step",
                                  description="Tokens emitted per verification step of one request "
                                              "(accepted draft tokens + 1).",
                                  boundaries=_ACCEPTED, tag_keys=tags)
        self.tree_nodes = Histogram("tr_serve_tree_nodes_per_step",
                                    description="Draft tree size (nodes) chosen per verification step.",
                                    boundaries=_NODES, tag_keys=tags)
        self.steps = Counter("tr_serve_engine_steps", description="Engine steps (prefill or verify).",
                             tag_keys=tags)
        self.running = Gauge("tr_serve_num_requests_running",
                             description="Requests holding a KV cache row (prefilling or decoding).",
                             tag_keys=tags)
        self.waiting = Gauge("tr_serve_num_requests_waiting", description="Requests waiting for a KV cache row.",
                             tag_keys=tags)
        self.kv_usage = Gauge("tr_serve_kv_cache_usage",
                              description="Fraction of KV cache rows in use (rows used / KV rows).",
                              tag_keys=tags)
        self.prefix_queries = Counter("tr_serve_prefix_cache_queries",
                                      description="Prompt tokens looked up in the prefix cache.", tag_keys=tags)
        self.prefix_hits = Counter("tr_serve_prefix_cache_hits",
                                   description="Prompt tokens found in the prefix cache (their prefill skipped).",
                                   tag_keys=tags)
        for m in (self.ttft, self.tpot, self.e2e, self.prompt_tokens, self.generated_tokens, self.accepted,
                  self.tree_nodes, self.steps, self.running, self.waiting, self.kv_usage, self.prefix_queries,
                  self.prefix_hits):
            m.set_default_tags({"model": model_id})
        self.finished.set_default_tags({"model": model_id})
        self._last: tuple = ()
        self._prefix_seen = (0, 0)  # the engine's monotonic (queries, hits) last counted
        self._lock = threading.Lock()

    def on_step(self, stats: dict[str, int]) -> None:
        """Per engine step (engine thread), with ``AsyncEngine.stats()``: gauges only on change."""
        self.steps.inc(1)
        self.engine_gauges(stats)

    def engine_gauges(self, stats: dict[str, int]) -> None:
        load = engine_load(stats)
        key = (load["num_running"], load["num_waiting"], stats["kv_rows_used"], load["num_rows"])
        prefix = (stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0))
        with self._lock:
            changed = key != self._last
            self._last = key
            seen, self._prefix_seen = self._prefix_seen, prefix
        # the prefix-cache counters from the engine's monotonic totals, by difference
        if prefix[0] > seen[0]:
            self.prefix_queries.inc(prefix[0] - seen[0])
        if prefix[1] > seen[1]:
            self.prefix_hits.inc(prefix[1] - seen[1])
        if changed:
            self.running.set(load["num_running"])
            self.waiting.set(load["num_waiting"])
            self.kv_usage.set(load["kv_cache_usage"])

def engine_load(stats: dict[str, int]) -> dict[str, int | float]:
    """The load fields of ``/v1/tr/stats`` and of the gauges, from ``AsyncEngine.stats()``:
    ``num_running`` counts every request holding a KV row (prefilling + decoding), as
    ``AsyncEngine.num_running`` does."""
    rows = stats["kv_rows"]
    return {"num_running": stats["running"] + stats["prefilling"], "num_decoding": stats["running"],
            "num_prefilling": stats["prefilling"], "num_waiting": stats["waiting"], "num_rows": rows,
            "kv_cache_usage": stats["kv_rows_used"] / rows if rows else 0.0}
