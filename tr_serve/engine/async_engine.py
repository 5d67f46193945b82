"""Continuous batching for asyncio callers: a background thread runs ``Engine.step()`` while any
request is waiting or running; callers get an async iterator of outputs per request.

The engine itself is single-threaded: callers never touch it directly, they post commands (add,
abort) that the step thread applies between steps, so requests join and leave between steps.
``AsyncEngine`` is an ``EngineHandle`` (engine/core.py) over the ``EngineCore`` it steps: the
server and the fleet sync use it through that contract only.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from tr_serve.engine.config import EngineConfig
from tr_serve.engine.core import EngineCore
from tr_serve.engine.openmp import release_thread_openmp_pool
from tr_serve.engine.prompt import check_prompt
from tr_serve.engine.request import FinishReason, RequestOutput
from tr_serve.engine.request_context import RequestContext
from tr_serve.engine.scheduler import EngineLoad
from tr_serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tr_serve.tr.matrix import AdjacencyMatrix

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop failed; the engine serves nothing more and its owner should be replaced."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (the log has the traceback); the others go on. The
    message names the request id only: an exception's text may hold another request's data."""

    def __init__(self, request_id: str):
        super().__init__(f"request {request_id} failed inside the engine")
        self.request_id = request_id


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class AsyncEngine:
    def __init__(self, engine: EngineCore, on_step: Callable[[EngineCore], None] | None = None):
        self.engine = engine  # stepped by this object's thread only
        self.config: EngineConfig = engine.config
        self.tokenizer: Any = engine.tokenizer
        self.on_step = on_step  # called on the step thread after each step (metrics, matrix sync)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self.error: BaseException | None = None
        # this thread's idle OpenMP workers would slow the step thread's team (see openmp.py)
        release_thread_openmp_pool()
        self._thread = threading.Thread(target=self._loop, name="tr-serve-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any thread with an event loop) -----------------------------------------
    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise now, in the caller, for a request that can never be served."""
        check_prompt(prompt_ids, self.config.max_model_len)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       context: RequestContext | None = None) -> AsyncIterator[RequestOutput]:
        """``context``: the request's tenant and switches (None: the shared tenant). Yields outputs with the new text/tokens of each step; the last one has ``finished``.
        Leaving the iteration early (break, cancellation, client gone) aborts the request."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped after an error: {self.error}")
        self.check_prompt(prompt_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, prompt_ids, params, context))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def call_between_steps(self, fn: Callable[[EngineCore], object]) -> "asyncio.Future":
        """Run ``fn(engine)`` on the step thread between two steps (e.g. adopt a new matrix);
        the returned future (of the caller's loop) resolves to its result or exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", fn, loop, future))
        self._wake.set()
        return future

    def commands_waiting(self) -> bool:
        """True once a command (a request, an abort, a call) or a shutdown waits for the step
        thread: what a long piece of work on that thread polls to give way (runner/startup_work.py)."""
        return self._stopped or not self._commands.empty()

    def shutdown(self) -> None:
        """Stop the step thread, then release what the engine holds elsewhere (tensor-parallel
        workers; an in-process engine can still be stepped by another wrapper)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    @property
    def alive(self) -> bool:
        """False once the step loop has died (an error) or was shut down."""
        return self._thread.is_alive() and self.error is None

    def check_health(self) -> None:
        """Raise once the step loop is gone or the engine reports itself unhealthy."""
        if not self.alive:
            reason = f"after an error: {self.error}" if self.error is not None else "(step thread gone)"
            raise RuntimeError(f"engine stopped {reason}")
        self.engine.check_health()

    @property
    def matrix(self) -> "AdjacencyMatrix | None":
        return self.engine.matrix

    def load(self) -> EngineLoad:
        return self.engine.load()

    @property
    def num_running(self) -> int:
        """Requests holding a KV row (prefilling or decoding)."""
        load = self.load()
        return load.running + load.prefilling

    @property
    def num_waiting(self) -> int:
        return self.load().waiting

    def stats(self) -> dict[str, int]:
        return self.load().as_dict()

    def tenant_matrix_stats(self) -> dict[str, int] | None:
        """The named tenants' matrix overlays on this replica, in total (tr/tenant_rows.py); None
        when the tree drafts from no matrix."""
        return self.engine.tenant_matrix_stats()

    # ---- step thread ------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, request_id, prompt_ids, params, context = cmd
                try:
                    self.engine.add_request(prompt_ids, params, request_id=request_id, context=context)
                except ValueError as e:
                    self._deliver(request_id, e)
                except Exception as e:  # this request's fault alone: it fails, the engine goes on
                    logger.exception("tr_serve: admitting request %s failed", request_id)
                    self._deliver(request_id, RequestFailedError(request_id))
            elif cmd[0] == "abort":
                self.engine.abort(cmd[1])
            elif cmd[0] == "call":
                _, fn, loop, future = cmd
                try:
                    result, error = fn(self.engine), None
                except Exception as e:  # reported to the caller; the engine goes on
                    result, error = None, e
                loop.call_soon_threadsafe(_settle, future, result, error)

    def _loop(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
                if self.on_step is not None:
                    self.on_step(self.engine)
            except BaseException as e:  # the engine's state is unknown now: fail loudly, serve nothing more
                logger.exception("engine step failed")
                self.error = e
                for request_id in list(self._streams):
                    self._deliver(request_id, EngineDeadError(f"engine step failed: {e}"))
                return
            for out in outputs:
                if out.finish_reason is FinishReason.ERROR:
                    self._deliver(out.request_id, RequestFailedError(out.request_id))
                else:
                    self._deliver(out.request_id, out)
