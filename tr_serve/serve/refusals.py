"""The ingress's refusals of a request it cannot serve now, as OpenAI error bodies with
``Retry-After`` where retrying helps: overloaded, unavailable, still starting, shutting down, too large,
not admitted within the queue timeout, over a key's concurrency cap."""

from __future__ import annotations

import math

from ray.serve.exceptions import BackPressureError

from tr_serve.serve.http_edge import UNAVAILABLE_RETRY_AFTER_S
from tr_serve.serve.protocol import APIError, echo, error_type_for

STARTING_RETRY_AFTER_S = 10  # a replica loading its weights takes tens of seconds
PER_KEY_RETRY_AFTER_S = 1  # a slot frees as soon as one of the caller's own requests ends


def overloaded(e: BackPressureError) -> APIError:
    retry = e.retry_after_s if e.retry_after_s is not None else 1.0
    status = e.status_code if e.status_code in (429, 503) else 503
    return APIError(status, f"the server is overloaded, retry later ({e.message})", error_type_for(status),
                    None, "overloaded", {"Retry-After": str(max(1, math.ceil(retry)))})


def unavailable(reason: str) -> APIError:
    return APIError(503, f"the model server is unavailable, retry later: {reason}", "service_unavailable_error",
                    None, "unavailable", {"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})


def starting(model: str, waited_s: float) -> APIError:
    waited = f" (waited {waited_s:.0f} s)" if waited_s >= 1 else ""
    return APIError(503, f"the model '{echo(model)}' is still starting: its first replica is loading{waited}; "
                         "retry later", "service_unavailable_error", None, "model_loading",
                    {"Retry-After": str(STARTING_RETRY_AFTER_S)})


def shutting_down(detail: str) -> APIError:
    return APIError(503, f"the server is shutting down: {detail}", "service_unavailable_error", None,
                    "shutting_down", {"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})


def too_large(limit: int, size: int | None) -> APIError:
    got = f" (Content-Length {size})" if size is not None else ""
    return APIError(413, f"the request body is larger than {limit} bytes{got} (max_request_bytes)",
                    "invalid_request_error", None, "request_too_large")


def queue_timeout(timeout_s: float) -> APIError:
    return APIError(503, f"the request waited {timeout_s:g} s for a model replica to take it and was cancelled "
                         "(queue_timeout_s); the server is busy, retry later", "service_unavailable_error", None,
                    "queue_timeout", {"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})


def too_many_requests(cap: int) -> APIError:
    return APIError(429, f"this API key has {cap} request(s) in flight, its limit "
                         "(max_concurrent_requests_per_key); retry when one has finished", "rate_limit_error", None,
                    "too_many_requests", {"Retry-After": str(PER_KEY_RETRY_AFTER_S)})
