"""``LLMServer``: the model server deployment. It owns one ``AsyncEngine`` (model, KV cache rows,
adjacency matrix) and turns validated OpenAI requests into engine requests and OpenAI responses.

Requests come in through ``completions`` / ``chat``, async generators whose first item is
``ACCEPTED`` (the request reached a live replica: the ingress stops counting it as waiting for
one), then either the chunks of a stream or one full response. They never raise for a bad
request: they yield an ``APIError`` that the ingress turns into the HTTP status, so one bad
request cannot take the replica down or touch another request. Tokenization runs in a worker
thread, never on the event loop that streams the other requests, and only after the prompt passed
a character bound. Cancelling a call (client gone) closes the engine stream, which aborts the
request in the engine.

Start-up: the replica is ready once the weights are loaded and the engine can run a forward. The
engine is built inside a :func:`~tr_serve.runner.startup_work.deferring` block, so what is not
cached yet (the kernel plan's measurement, the matrix prior) becomes start-up work that a task of
this replica runs after ``__init__`` returned, in slices on the engine's step thread between steps:
back to back while no request is running, at most ``STARTUP_BUSY_SHARE`` of the time otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Union

from tr_serve.engine.request_context import DEFAULT_CONTEXT, RequestContext
from tr_serve.serve.config import TRServeConfig
from tr_serve.serve.prepare import OpenAIRequest, PreparedRequest, prepare_request
from tr_serve.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, bad_request, now,
                                     prompt_too_long)
from tr_serve.serve.responses import responses_for

logger = logging.getLogger("ray.serve")

ACCEPTED = "tr_serve:accepted"  # first item of every request generator: a live replica has it
STARTUP_SLICE_S = 0.25  # deferred start-up work runs in slices of about this long (a request waits at most one)
STARTUP_BUSY_SHARE = 0.1  # while requests run, start-up work takes at most this share of the step thread


def _request_failed(request_id: str) -> APIError:
    """The 500 of one request that failed: its id, never the exception's text (which may hold
    another request's data); the replica's log has the traceback under that id."""
    return APIError(500, f"internal error while serving request {request_id}; the server log has the details "
                         "under this id", "server_error", code="request_failed")


class LLMServer:
    async def __init__(self, config: TRServeConfig | dict):
        import torch

        from tr_serve.engine.async_engine import AsyncEngine
        from tr_serve.engine.engine import Engine
        from tr_serve.model_loader import load_model
        from tr_serve.runner.startup_work import deferring
        from tr_serve.serve.metrics import ServerMetrics

        self.config = TRServeConfig.from_args(config)
        self.model_id = self.config.served_model_id
        threads = self.config.resolved_cpu_threads()
        if threads:
            torch.set_num_threads(threads)
        engine_config = self.config.engine_config()
        t0 = time.monotonic()
        with deferring() as self.startup:  # nothing but the weights and a forward before ready (module docstring)
            if self.config.tensor_parallel_size > 1:  # the same Engine; its runner's workers hold the shards (tr_serve/tp)
                from tr_serve.tp.runner import tp_engine

                core = await asyncio.to_thread(tp_engine, engine_config.model, engine_config,
                                               self.config.tensor_parallel_size, worker_cpus=self.config.worker_cpus,
                                               step_timeout_s=self.config.step_timeout_s,
                                               init_timeout_s=self.config.init_timeout_s)
                self.tokenizer, self.vocab_size = core.tokenizer, int(core.runner.vocab_size)
            else:
                loaded = await asyncio.to_thread(load_model, engine_config.model, engine_config.device,
                                                 engine_config.dtype)
                self.tokenizer = loaded.tokenizer
                self.vocab_size = int(loaded.model.config.vocab_size)
                core = Engine(loaded, engine_config)
        self.max_model_len = engine_config.max_model_len
        self.max_prompt_chars = self.config.resolved_max_prompt_chars()
        self.metrics = ServerMetrics(self.model_id)
        # the step thread only steps once a request came through self.engine, so self.engine is set by then
        self.engine = AsyncEngine(core,
                                  on_step=lambda _engine: self.metrics.on_step(self.engine.stats()))
        self.metrics.engine_gauges(self.engine.stats())
        from tr_serve.fleet.sync import start_fleet_sync

        # keyed by the weights (EngineConfig.model), not the served name; None when disabled. Never on
        # the token path.
        self.fleet = None if self.engine.matrix is None else await start_fleet_sync(
            self.engine, self.config.fleet, model_id=engine_config.model, tokenizer=self.tokenizer)
        self.num_finished = 0  # requests that ran to a finish_reason
        self.num_aborted = 0  # requests whose caller left first (client disconnect, cancellation)
        logger.info("tr_serve: %s loaded as %r in %.1f s (tree %s, max_num_seqs %d, max_model_len %d, device %s)%s",
                    engine_config.model, self.model_id, time.monotonic() - t0, engine_config.tree,
                    engine_config.max_num_seqs, engine_config.max_model_len, engine_config.device,
                    f"; after ready: {', '.join(self.startup.pending)}" if self.startup.pending else "")
        self._startup_task = (asyncio.get_running_loop().create_task(self._run_startup_work(), name="tr-serve-startup")
                              if self.startup.pending else None)

    async def _run_startup_work(self) -> None:
        """The deferred start-up work (module docstring), one slice per call between steps."""
        work = self.startup
        try:
            while work.pending and self.engine.alive:
                t0 = time.monotonic()
                await self.engine.call_between_steps(
                    lambda core: work.advance(STARTUP_SLICE_S, core.runner, core.matrix, not core.has_unfinished(),
                                              self.engine.commands_waiting))
                if self.engine.num_running or self.engine.num_waiting:  # leave the step thread to the requests
                    await asyncio.sleep((time.monotonic() - t0) * (1 / STARTUP_BUSY_SHARE - 1))
                else:
                    await asyncio.sleep(0)
            if not work.pending:
                logger.info("tr_serve: start-up work done in %.1f s of slices (%s%s)", work.seconds,
                            ", ".join(work.done) or "nothing", f"; failed: {', '.join(work.failed)}" if work.failed
                            else "")
        except asyncio.CancelledError:
            raise
        except Exception:  # the engine stopped meanwhile: its health check reports that
            logger.warning("tr_serve: start-up work stopped", exc_info=True)

    # ---- Serve hooks --------------------------------------------------------------------------
    def check_health(self) -> None:
        self.engine.check_health()  # the step thread, then the engine (tensor parallel: pings every worker)

    async def __del__(self) -> None:
        """Serve awaits this at shutdown: a last push of the matrix rows, then the engine stops."""
        task = getattr(self, "_startup_task", None)
        if task is not None:
            task.cancel()
        fleet = getattr(self, "fleet", None)
        if fleet is not None:
            await fleet.stop(final_push=True, timeout_s=5.0)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()  # the step thread, then what the engine holds elsewhere (tensor-parallel workers)

    # ---- methods called through the handle ------------------------------------------------------
    async def ping(self) -> dict[str, Any]:
        """The ingress's availability probe (a broadcast, outside the request queue)."""
        return {"model": self.model_id, "alive": self.engine.alive}

    async def engine_stats(self) -> dict[str, Any]:
        """Load of this replica (no matrix contents). ``num_running`` counts every request that
        holds a KV row (prefilling or decoding)."""
        from ray import serve

        from tr_serve.serve.metrics import engine_load

        try:
            replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside a Serve replica (direct construction in tests)
            replica = None
        return {"model": self.model_id, "replica": replica, **engine_load(self.engine.stats()),
                "max_num_seqs": self.config.engine_kwargs.max_num_seqs,
                "tree": self.config.engine_kwargs.tree, "engine_alive": self.engine.alive,
                "requests_finished": self.num_finished, "requests_aborted": self.num_aborted,
                "startup_work": self.startup.status(),
                "tenant_matrix": self.engine.tenant_matrix_stats(),
                "fleet": self.fleet.stats() if getattr(self, "fleet", None) is not None else None}

    async def completions(self, request: CompletionRequest, request_id: str,
                          context: RequestContext | None = None) -> AsyncIterator:
        """``ACCEPTED``, then the chunks (``request.stream``) or the full response, or an APIError.
        ``context``: the caller's tenant and switches, made by the ingress (engine/request_context.py)."""
        yield ACCEPTED
        async with aclosing(self._respond(request, request_id, context or DEFAULT_CONTEXT)) as items:
            async for item in items:
                yield item

    async def chat(self, request: ChatCompletionRequest, request_id: str,
                   context: RequestContext | None = None) -> AsyncIterator:
        yield ACCEPTED
        async with aclosing(self._respond(request, request_id, context or DEFAULT_CONTEXT)) as items:
            async for item in items:
                yield item

    async def _respond(self, request: OpenAIRequest, request_id: str, context: RequestContext) -> AsyncIterator:
        context = request.request_context(context)  # the body's own switches ("tr": {...})
        try:
            if request.stream:
                async with aclosing(self._stream(request, request_id, context)) as items:
                    async for item in items:
                        yield item
            else:
                yield await self._full(request, request_id, context)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:  # preparing or finishing this request failed: it alone gets the 500
            logger.exception("tr_serve: request %s failed", request_id)
            yield _request_failed(request_id)

    async def _prepare_off_loop(self, request: OpenAIRequest) -> Union[PreparedRequest, APIError]:
        """``prepare_request`` in a worker thread: tokenizing (up to ``max_prompt_chars`` characters)
        never holds up the event loop that streams the other requests."""
        chars = request.prompt_chars()
        if chars > self.max_prompt_chars:
            return prompt_too_long(chars, self.max_prompt_chars, request.prompt_param)
        return await asyncio.to_thread(prepare_request, request, self.tokenizer, self.vocab_size, self.max_model_len,
                                       self.config.default_max_tokens)

    async def _outputs(self, ids, params, request_id: str, context: RequestContext):
        """Engine outputs with metrics; closing this generator aborts the engine request."""
        m = self.metrics
        t0 = time.monotonic()
        first_at = None
        seen_steps = 0
        last = None
        gen = self.engine.generate(ids, params, request_id, context)
        try:
            async for out in gen:
                last = out
                if first_at is None and out.new_token_ids:
                    first_at = time.monotonic()
                    m.ttft.observe(first_at - t0)
                steps = out.stats.accepted_per_step
                nodes = out.stats.tree_nodes_per_step
                for i in range(seen_steps, len(steps)):
                    m.accepted.observe(steps[i])
                    if i < len(nodes):
                        m.tree_nodes.observe(nodes[i])
                seen_steps = len(steps)
                yield out
        finally:
            await gen.aclose()  # type: ignore[attr-defined]  # AsyncEngine.generate is an async generator
            end = time.monotonic()
            m.prompt_tokens.inc(len(ids))
            if last is not None and last.finished:
                n_out = len(last.token_ids)
                m.generated_tokens.inc(n_out)
                m.e2e.observe(end - t0)
                if first_at is not None and n_out > 1:
                    m.tpot.observe((end - first_at) / (n_out - 1))
                m.finished.inc(1, tags={"finish_reason": last.finish_reason.value})
                self.num_finished += 1
            else:
                self.num_aborted += 1
                if last is not None:
                    m.generated_tokens.inc(len(last.token_ids))
                m.finished.inc(1, tags={"finish_reason": "abort"})

    @staticmethod
    def _engine_error(e: BaseException, request_id: str) -> APIError:
        from tr_serve.engine.async_engine import EngineDeadError, RequestFailedError

        if isinstance(e, RequestFailedError):
            return _request_failed(request_id)

        if isinstance(e, EngineDeadError):
            return APIError(503, f"the model server is restarting: {e}", "service_unavailable_error",
                            code="engine_dead", headers={"Retry-After": "5"})
        if isinstance(e, ValueError):  # the engine refused the request (prompt too long, ...)
            return bad_request(str(e))
        logger.exception("tr_serve: request %s failed", request_id)
        return _request_failed(request_id)

    def _tr(self, stats) -> dict[str, Any]:
        return {"mat": round(stats.mat, 4), "verification_steps": stats.verification_steps,
                "accepted_per_step": stats.accepted_per_step,  # RequestOutput.stats is a snapshot
                "tree_nodes_per_step": stats.tree_nodes_per_step, "tree": self.config.engine_kwargs.tree}

    async def _full(self, request: OpenAIRequest, request_id: str, context: RequestContext) -> Union[dict, APIError]:
        prepared = await self._prepare_off_loop(request)
        if isinstance(prepared, APIError):
            return prepared
        ids, params = prepared.prompt_ids, prepared.params
        responses = responses_for(request, request_id, self.model_id, now())
        last = None
        try:
            async with aclosing(self._outputs(ids, params, request_id, context)) as outputs:
                async for out in outputs:
                    last = out
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return self._engine_error(e, request_id)
        if last is None:
            return APIError(500, "the engine returned no output", "server_error")
        reason = last.finish_reason.value if last.finish_reason else None
        return responses.full(last.text, reason, len(ids), len(last.token_ids), self._tr(last.stats),
                              last.stats.cached_tokens)

    async def _stream(self, request: OpenAIRequest, request_id: str,
                      context: RequestContext) -> AsyncIterator[Union[dict, APIError]]:
        """Yields an APIError (then stops) or OpenAI chunk dicts. The ingress frames them as SSE."""
        prepared = await self._prepare_off_loop(request)
        if isinstance(prepared, APIError):
            yield prepared
            return
        ids, params = prepared.prompt_ids, prepared.params
        responses = responses_for(request, request_id, self.model_id, now())
        first = responses.first_chunk()
        if first is not None:  # accepted: the chat role chunk goes out before the prefill
            yield first
        last = None
        try:
            async with aclosing(self._outputs(ids, params, request_id, context)) as outputs:
                async for out in outputs:
                    last = out
                    if out.new_text:
                        yield responses.chunk(out.new_text)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            yield self._engine_error(e, request_id)
            return
        if last is None:
            yield APIError(500, "the engine returned no output", "server_error")
            return
        reason = last.finish_reason.value if last.finish_reason else None
        yield responses.chunk("", reason, tr=self._tr(last.stats))
        if responses.include_usage:
            yield responses.usage_chunk(len(ids), len(last.token_ids), last.stats.cached_tokens)
