"""Helpers of the Serve tests (a uniquely named module: other test folders have their own conftest)."""

from __future__ import annotations

import os
import socket

SERVE_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(SERVE_ENV)
    env["RAY_ADDRESS"] = "local"  # a fresh local cluster, never someone else's
    env.pop("TR_SERVE_API_KEYS", None)
    env.update(extra)
    return env


class AcceptedThenOk:
    """A stand-in for a model server handle call's response stream: ``ACCEPTED``, then one full
    completion whose text is "ok" (the ingress tests run without Ray)."""

    def __init__(self):
        from tr_serve.serve.server import ACCEPTED

        self.items = [ACCEPTED, {"object": "text_completion", "choices": [{"text": "ok"}]}]

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self):
        pass


class LiveHandle:
    """The part of a model server handle the ingress probes: ``options`` and a ``broadcast`` whose
    one replica answers alive for ``model``. Ingress tests subclass it with their own routes."""

    model = "m"

    def options(self, **kwargs):
        return self

    def broadcast(self, method: str):
        model = self.model

        class _B:
            async def results_async(self, timeout_s, return_exceptions):
                return [{"model": model, "alive": True}]
        return _B()
