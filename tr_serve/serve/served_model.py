"""One served model as the ingress's probe last saw it: started (a replica answered once),
available (a replica answers now), and the events requests wait on."""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger("ray.serve")


class ServedModel:
    """One served model: its handles, limits and availability as the probe last saw it."""

    def __init__(self, name: str, handle, max_prompt_chars: int):
        self.name = name
        self.handle = handle
        self.stream_handle = handle.options(stream=True)
        self.max_prompt_chars = max_prompt_chars
        # Serve routes HTTP here before the model's replicas have loaded: nothing is up until the probe says so
        self.available = False
        self.reason = "starting"
        self.down_since: float | None = None
        self.gone = asyncio.Event()  # set while the model has no live replica
        self.gone.set()
        self.ready = asyncio.Event()  # set once a replica has answered: the model has started

    @property
    def started(self) -> bool:
        return self.ready.is_set()

    def mark_down(self, reason: str) -> None:
        if not self.started:  # still loading: Serve has no running replica yet, nothing went wrong
            self.reason = "starting"
            return
        if self.available:
            logger.warning("tr_serve: model %r unavailable (%s): requests get 503 until a replica answers",
                           self.name, reason)
            self.down_since = time.monotonic()
        self.available, self.reason = False, reason
        self.gone.set()

    def mark_up(self) -> None:
        if not self.started:
            logger.info("tr_serve: model %r is ready", self.name)
        elif not self.available:
            logger.info("tr_serve: model %r available again after %.1f s", self.name,
                        time.monotonic() - (self.down_since or time.monotonic()))
        self.available, self.reason, self.down_since = True, "", None
        self.gone.clear()
        self.ready.set()
