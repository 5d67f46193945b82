"""``OpenAIIngress``: the HTTP edge. FastAPI app with the OpenAI routes, API-key auth, request
validation in OpenAI's error shape, routing by ``model`` to the model server deployments (one
``DeploymentHandle`` per served model id) and SSE framing of their streamed chunks. The ASGI
middlewares and response classes under it are serve/http_edge.py, its refusals serve/refusals.py,
a model's availability serve/served_model.py.

No model and no torch here: the ingress only parses, routes and frames. What it guards:

- **Cost before work.** The body is read up to ``max_request_bytes`` (a larger ``Content-Length``
  is refused before a byte is read), parsed, checked for nesting depth and lone surrogates, then
  validated; fields the server cannot honour and prompts over ``max_prompt_chars`` are refused
  here, so nothing of that crosses to a model replica.
- **Every refusal is an OpenAI error body**, whatever produced it: this module's checks, Serve's
  backpressure inside this replica (``OpenAIErrorMiddleware`` rewrites Serve's plain-text bodies),
  a dead or restarting model replica. User strings are echoed only through ``protocol.echo`` and
  every error body is rendered as ASCII JSON.
- **Availability.** A probe broadcasts ``ping`` to each model's replicas every
  ``PROBE_INTERVAL_S``; while a model has no live replica, its requests get a fast 503 with
  ``Retry-After`` instead of waiting in Serve's queue for a replica to come back, and requests
  already waiting for one are released with that 503.
- **Start-up.** A model is listed (``/v1/models``) and counted by ``/health`` only once a replica
  of it has answered the probe: Serve routes HTTP to the ingress before the model replicas have
  loaded. A request for a model whose first replica is still starting waits for it up to
  ``startup_wait_s``, then gets 503 (code ``model_loading``) with ``Retry-After``.
- **Admission.** With ``queue_timeout_s``, a request that no model replica has taken (its
  ``ACCEPTED``) that long after it was sent is cancelled, out of Serve's queue, and answered 503
  (code ``queue_timeout``). With ``max_concurrent_requests_per_key``, a key (or a ``tenants`` group)
  with that many generation requests in flight on this ingress replica gets 429 (code
  ``too_many_requests``) for one more, before its body is read; a slot is freed when its response
  ends (a stream's end or its client leaving included).
- **Drain.** ``drain()`` (called by ``tr-serve run`` on SIGINT/SIGTERM) refuses new generation
  requests with 503 and gives the ones in flight ``drain_timeout_s`` to finish; then a stream
  ends with an in-band error event and ``data: [DONE]``, a non-streamed request with a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tr_serve.serve.protocol import (APIError, APIErrorException, ChatCompletionRequest, CompletionRequest,
                                     bad_request, check_json, echo, error_type_for, new_id, prompt_too_long,
                                     validation_error)
from tr_serve.engine.request_context import DEFAULT_CONTEXT, SHARED_TENANT, RequestContext
from tr_serve.serve.http_edge import (CALLER_STATE, TENANT_STATE, APIKeyMiddleware, OpenAIErrorMiddleware, SSEResponse,
                                      error_response, sse_json)
from tr_serve.serve.tenants import TenantDirectory
from tr_serve.serve import refusals
from tr_serve.serve.served_model import ServedModel
from tr_serve.serve.server import ACCEPTED

logger = logging.getLogger("ray.serve")


ENDPOINTS = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/tr/stats"})
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 5.0
PARSE_IN_THREAD_BYTES = 64 * 1024  # larger bodies are parsed and walked in a worker thread
DEFAULT_LIMITS = {"max_request_bytes": 327680, "max_json_depth": 32, "drain_timeout_s": 30.0,
                  "startup_wait_s": 60.0, "queue_timeout_s": None, "max_concurrent_requests_per_key": None}


def _consume(task: asyncio.Future) -> None:
    """Done callback of a task whose result nobody awaits: retrieve its exception (no log noise)."""
    if not task.cancelled():
        task.exception()


def _no_slot() -> None:
    """The release of a request that holds no per-key slot (no cap configured)."""


def _cancel(gen) -> None:
    """Cancel a handle call whatever state it is in (``cancel()`` re-raises an assignment error)."""
    try:
        gen.cancel()
    except Exception:
        pass


@serve.ingress()
class OpenAIIngress:
    """``llm_deployments`` maps served model ids to model server deployments (handles at run time);
    ``model_cards`` holds the ``/v1/models`` entry of each; ``limits`` the edge limits
    (``max_request_bytes``, ``max_json_depth``, ``drain_timeout_s``, ``startup_wait_s``,
    ``queue_timeout_s``, ``max_concurrent_requests_per_key``, ``max_prompt_chars`` per model)."""

    def __init__(self, llm_deployments: dict, model_cards: dict[str, dict], api_keys: Optional[list[str]] = None,
                 limits: Optional[dict[str, Any]] = None, tenants: Optional[dict[str, list[str]]] = None,
                 isolation: str = "tenant"):
        from tr_serve.serve.config import env_api_keys
        from tr_serve.serve.metrics import IngressMetrics

        limits = {**DEFAULT_LIMITS, **(limits or {})}
        chars = dict(limits.get("max_prompt_chars") or {})
        self.models = {name: ServedModel(name, h, int(chars.get(name, 64 * 2048))) for name, h in llm_deployments.items()}
        self.model_cards = dict(model_cards)
        self.max_request_bytes = int(limits["max_request_bytes"])
        self.max_json_depth = int(limits["max_json_depth"])
        self.drain_timeout_s = float(limits["drain_timeout_s"])
        self.startup_wait_s = float(limits["startup_wait_s"])
        queue_timeout = limits.get("queue_timeout_s")
        self.queue_timeout_s: float | None = float(queue_timeout) if queue_timeout is not None else None
        cap = limits.get("max_concurrent_requests_per_key")
        self.max_concurrent_per_key: int | None = int(cap) if cap is not None else None
        self._per_key: dict[str, int] = {}  # caller id -> its generation requests in flight here
        # keys given at build time, plus the env var as this replica sees it
        # each key's tenant (serve/tenants.py): a key of its own, or one of a declared group
        keys = sorted(set(api_keys or []) | set(env_api_keys()))
        self.tenants = TenantDirectory.from_config(keys, dict(tenants or {}), isolation)
        # the per-key cap counts keys and groups even where isolation maps them all to one tenant
        self.callers = (TenantDirectory.from_config(keys, dict(tenants or {}), "tenant")
                        if self.max_concurrent_per_key is not None and isolation == "none" else None)
        self.metrics = IngressMetrics()
        self.draining = False
        self.drain_started: float | None = None
        self.in_flight = 0
        self._drain_at: float | None = None  # event-loop time at which in-flight requests are cut
        self._timeouts: set = set()  # asyncio.Timeout of every await on a model replica
        self._monitor: asyncio.Task | None = None
        self._probe_now = asyncio.Event()
        self._probed = asyncio.Event()  # set once the first probe round is done
        self._draining = asyncio.Event()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi_app(self)

    # ---- control plane (called through the handle by `tr-serve run` and tests) ---------------
    async def drain(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Refuse new generation requests (503); in-flight ones get ``timeout_s`` (default
        ``drain_timeout_s``) to finish, then end with an error. Idempotent."""
        if not self.draining:
            grace = self.drain_timeout_s if timeout_s is None else max(0.0, float(timeout_s))
            self.draining = True
            self._draining.set()  # requests waiting for a model to start stop waiting
            self.drain_started = time.monotonic()
            self._drain_at = asyncio.get_running_loop().time() + grace
            for t in list(self._timeouts):
                t.reschedule(self._drain_at)
            logger.info("tr_serve: draining: %d request(s) in flight get %.1f s to finish", self.in_flight, grace)
        return await self.drain_status()

    async def drain_status(self) -> dict[str, Any]:
        return {"draining": self.draining, "in_flight": self.in_flight,
                "models": {n: {"available": m.available, "started": m.started, "reason": m.reason}
                           for n, m in self.models.items()}}

    # ---- availability probe -------------------------------------------------------------------
    def _ensure_monitor(self) -> None:
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self._monitor_loop(), name="tr-serve-probe")

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.gather(*[self._probe(m) for m in self.models.values()])
            self._probed.set()
            self._probe_now.clear()
            try:
                await asyncio.wait_for(self._probe_now.wait(), PROBE_INTERVAL_S)
            except asyncio.TimeoutError:
                pass

    async def _probe(self, model: ServedModel) -> None:
        import ray.exceptions

        try:
            results = await model.handle.broadcast("ping").results_async(timeout_s=PROBE_TIMEOUT_S,
                                                                          return_exceptions=True)
        except DeploymentUnavailableError:
            model.mark_down("no running replica")
            return
        except TimeoutError:  # slow, not gone: Serve's health check decides about slow replicas
            return
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            model.mark_down(type(e).__name__)
            return
        except Exception:
            logger.warning("tr_serve: availability probe of %r failed", model.name, exc_info=True)
            return
        if any(isinstance(r, dict) and r.get("alive") for r in results):
            model.mark_up()
        else:
            reasons = sorted({type(r).__name__ if isinstance(r, BaseException) else "engine stopped"
                              for r in results}) or ["no running replica"]
            model.mark_down(", ".join(reasons))

    # ---- helpers ------------------------------------------------------------------------------
    def count(self, model: str, endpoint: str, status: int | str) -> None:
        try:
            self.metrics.request(model if model in self.models else "",
                                 endpoint if endpoint in ENDPOINTS else "other", status)
        except Exception:  # metrics never fail a request
            logger.debug("metrics failed", exc_info=True)

    def refuse(self, model: str, endpoint: str, err: APIError) -> JSONResponse:
        self.count(model, endpoint, err.status_code)
        return error_response(err)

    async def read_request(self, request: Request, model_cls):
        """The body, size-bounded, parsed, depth/surrogate-checked and validated: a model or an APIError."""
        limit = self.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return bad_request("invalid Content-Length header", None, "invalid_body")
            if size > limit:
                return refusals.too_large(limit, size)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return refusals.too_large(limit, None)
            chunks.append(chunk)
        raw = b"".join(chunks)
        if len(raw) > PARSE_IN_THREAD_BYTES:
            return await asyncio.to_thread(self._decode, raw, model_cls)
        return self._decode(raw, model_cls)

    def _decode(self, raw: bytes, model_cls):
        if not raw.strip():
            return bad_request("request body is missing: send a JSON object", None, "missing_body")
        try:
            obj = json.loads(raw)
        except RecursionError:
            return bad_request(f"the request body nests more than {self.max_json_depth} levels of objects and "
                               "arrays", None, "invalid_body")
        except UnicodeDecodeError as e:
            return bad_request(f"request body is not valid UTF-8: {echo(e.reason, 100)} at byte {e.start}", None,
                               "invalid_json")
        except ValueError as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else echo(e, 100)
            return bad_request(f"request body is not valid JSON: {msg}", None, "invalid_json")
        if not isinstance(obj, dict):
            return bad_request("request body must be a JSON object (Content-Type: application/json)", None,
                               "invalid_body")
        err = check_json(obj, self.max_json_depth)
        if err is not None:
            return err
        try:
            return model_cls.model_validate(obj)
        except ValidationError as e:
            return validation_error(list(e.errors(include_url=False, include_input=False)))

    def _take_slot(self, caller: str) -> Optional[Callable[[], None]]:
        """One of ``caller``'s ``max_concurrent_requests_per_key`` slots: its release (idempotent), or
        None when the caller holds them all."""
        cap = self.max_concurrent_per_key
        if cap is None:
            return _no_slot
        held = self._per_key.get(caller, 0)
        if held >= cap:
            return None
        self._per_key[caller] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self._per_key.get(caller, 0) - 1
            if left > 0:
                self._per_key[caller] = left
            else:  # no entry per caller that has nothing in flight: the map stays as small as the load
                self._per_key.pop(caller, None)
        return release

    async def handle_generation(self, request: Request, model_cls, endpoint: str, method: str, id_prefix: str):
        self._ensure_monitor()
        if self.draining:
            return self.refuse("", endpoint, refusals.shutting_down("not accepting new requests"))
        tenant = getattr(request.state, TENANT_STATE, SHARED_TENANT)  # no keys: one tenant
        release = self._take_slot(getattr(request.state, CALLER_STATE, tenant))
        if release is None:  # before the body is read: a caller over its cap costs nothing more
            return self.refuse("", endpoint, refusals.too_many_requests(self.max_concurrent_per_key or 0))
        response = None
        try:
            response = await self._handle_generation(request, model_cls, endpoint, method, id_prefix, tenant, release)
            return response
        finally:
            if not isinstance(response, SSEResponse):  # a stream releases its slot when it closes
                release()

    async def _handle_generation(self, request: Request, model_cls, endpoint: str, method: str, id_prefix: str,
                                 tenant: str, release: Callable[[], None]):
        body = await self.read_request(request, model_cls)
        if isinstance(body, APIError):
            return self.refuse("", endpoint, body)
        err = body.unsupported()
        if err is not None:
            return self.refuse("", endpoint, err)
        model = self.models.get(body.model)
        if model is None:
            return self.refuse("", endpoint, APIError(
                404, f"the model '{echo(body.model)}' does not exist; available: {sorted(self.models)}",
                "invalid_request_error", "model", "model_not_found"))
        chars = body.prompt_chars()
        if chars > model.max_prompt_chars:
            return self.refuse(body.model, endpoint, prompt_too_long(chars, model.max_prompt_chars,
                                                                     body.prompt_param))
        if not model.started:
            waited = await self.wait_started(model)
            if self.draining:
                return self.refuse(body.model, endpoint, refusals.shutting_down("not accepting new requests"))
            if not model.started:
                return self.refuse(body.model, endpoint, refusals.starting(model.name, waited))
        if not model.available:
            return self.refuse(body.model, endpoint, refusals.unavailable(model.reason))
        return await self.generate(body, model, endpoint, method, id_prefix, RequestContext(tenant=tenant), release)

    async def wait_started(self, model: ServedModel) -> float:
        """Wait up to ``startup_wait_s`` for the model's first replica (or a drain); the seconds waited."""
        t0 = time.monotonic()
        if self.startup_wait_s <= 0:
            return 0.0
        started = asyncio.ensure_future(model.ready.wait())
        draining = asyncio.ensure_future(self._draining.wait())
        try:
            await asyncio.wait({started, draining}, timeout=self.startup_wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
            draining.cancel()
        return time.monotonic() - t0

    async def _next(self, gen):
        """The next item of a handle stream; ``TimeoutError`` once a drain's deadline has passed."""
        async with asyncio.timeout_at(self._drain_at) as t:
            self._timeouts.add(t)
            try:
                return await gen.__anext__()
            finally:
                self._timeouts.discard(t)

    async def _accepted(self, gen, model: ServedModel) -> Optional[APIError]:
        """Wait until a live replica took the request (its ``ACCEPTED``): None, or the APIError
        that ends it. Released with a 503 when the model loses its last replica meanwhile, or when
        ``queue_timeout_s`` passes first; either way the call is cancelled: a request still in
        Serve's queue leaves it, one a replica has just taken is aborted there."""
        nxt = asyncio.ensure_future(self._next(gen))
        nxt.add_done_callback(_consume)
        gone = asyncio.ensure_future(model.gone.wait())
        try:
            done, _ = await asyncio.wait({nxt, gone}, timeout=self.queue_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not nxt.done():
                _cancel(gen)
                nxt.cancel()
        if not nxt.done() or nxt.cancelled():
            if not done:  # neither came: the queue timeout passed
                return refusals.queue_timeout(self.queue_timeout_s or 0.0)
            return refusals.unavailable(model.reason or "no running replica")
        try:
            item = nxt.result()
        except StopAsyncIteration:
            return APIError(500, "the model server returned nothing", "server_error")
        except Exception as e:
            return self._failure(e, model)
        if item != ACCEPTED:
            return item if isinstance(item, APIError) else APIError(500, "unexpected reply from the model server",
                                                                    "server_error")
        return None

    def _failure(self, e: BaseException, model: ServedModel | None) -> APIError:
        import ray.exceptions

        if isinstance(e, BackPressureError):
            return refusals.overloaded(e)
        if isinstance(e, TimeoutError):  # the drain deadline passed
            return refusals.shutting_down("the request did not finish within the drain timeout")
        if isinstance(e, (DeploymentUnavailableError, ray.exceptions.RayActorError,
                          ray.exceptions.ActorUnavailableError, RequestCancelledError,
                          ray.exceptions.TaskCancelledError)):
            self._probe_now.set()  # find out now whether any replica is left
            return refusals.unavailable(type(e).__name__)
        logger.exception("tr_serve: request to the model server failed")
        return APIError(500, f"internal error: {type(e).__name__}", "server_error")

    async def generate(self, body, model: ServedModel, endpoint: str, method: str, id_prefix: str,
                       context: RequestContext = DEFAULT_CONTEXT, release: Callable[[], None] = _no_slot):
        """Send the request to the model server and answer it; a streamed response takes ``release``
        (the caller's per-key slot) and calls it once the stream is done with."""
        request_id = new_id(id_prefix)
        name = model.name
        gen = getattr(model.stream_handle, method).remote(body, request_id, context)
        self.in_flight += 1
        handed_over = False  # to the SSE response, which then owns gen and the in-flight count
        try:
            err = await self._accepted(gen, model)
            if err is None:
                try:
                    first = await self._next(gen)
                except StopAsyncIteration:
                    first = APIError(500, "the model server returned nothing", "server_error")
                except Exception as e:
                    first = self._failure(e, model)
            else:
                first = err
            if isinstance(first, APIError):
                return self.refuse(name, endpoint, first)
            if not body.stream:
                self.count(name, endpoint, 200)
                return JSONResponse(first)
            response = SSEResponse(self._sse(first, gen, model, endpoint), on_close=lambda: self._closed(gen, release),
                                    media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            handed_over = True
            return response
        except asyncio.CancelledError:
            self.count(name, endpoint, 499)
            raise
        finally:
            if not handed_over:
                _cancel(gen)
                self.in_flight -= 1

    def _closed(self, gen, release: Callable[[], None] = _no_slot) -> None:
        _cancel(gen)  # no-op when the stream ran to its end
        self.in_flight -= 1
        release()

    async def _sse(self, first, gen, model: ServedModel, endpoint: str):
        """``data: {json}`` per chunk, then ``data: [DONE]``; a failure after the 200 went out is an
        in-band error event, then ``[DONE]``. Leaving early (client gone) cancels the handle's
        generator, which aborts the request in the engine."""
        status: int = 499
        try:
            yield f"data: {sse_json(first)}\n\n"
            while True:
                try:
                    item = await self._next(gen)
                except StopAsyncIteration:
                    status = 200
                    break
                except Exception as e:
                    item = self._failure(e, model)
                if isinstance(item, APIError):
                    status = item.status_code
                    yield f"data: {json.dumps(item.body(), ensure_ascii=True, separators=(',', ':'))}\n\n"
                    break
                yield f"data: {sse_json(item)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.count(model.name, endpoint, status)


def build_fastapi_app(ingress: OpenAIIngress) -> FastAPI:
    app = FastAPI(title="tr_serve", description="OpenAI-compatible API of a Token Recycling engine",
                  docs_url=None, redoc_url=None, openapi_url=None)
    if ingress.tenants:
        app.add_middleware(APIKeyMiddleware, tenants=ingress.tenants, callers=ingress.callers,
                           on_reject=lambda path: ingress.count("", path, 401))
    app.add_middleware(OpenAIErrorMiddleware)  # added last: the outermost

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        err = validation_error(list(exc.errors()))
        ingress.count("", request.url.path, 400)
        return error_response(err)

    @app.exception_handler(APIErrorException)
    async def _api_error(request, exc: APIErrorException):
        return error_response(exc.error)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        status = exc.status_code
        err = APIError(status, echo(exc.detail, 300), error_type_for(status), None, None, dict(exc.headers or {}))
        return error_response(err)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        logger.exception("tr_serve: unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", "server_error"))

    async def probed() -> None:
        """The first call waits for the first probe round, so a replica still loading is not
        reported as up, nor one already up as missing."""
        ingress._ensure_monitor()
        try:
            await asyncio.wait_for(ingress._probed.wait(), PROBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass

    @app.get("/health")
    async def health():
        """200 when the app can serve: not draining and some model has a live replica."""
        await probed()
        if ingress.draining:
            return error_response(refusals.shutting_down("draining"))
        starting = sorted(n for n, m in ingress.models.items() if not m.started)
        down = sorted(n for n, m in ingress.models.items() if not m.available)
        if down and len(down) == len(ingress.models):
            if starting == down:
                return error_response(refusals.starting(", ".join(starting), 0.0))
            return error_response(refusals.unavailable(f"no live replica of {down}"))
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models():
        """The models that have started (a replica answered): what ``/health`` counts."""
        await probed()
        ingress.count("", "/v1/models", 200)
        return {"object": "list", "data": [card for name, card in ingress.model_cards.items()
                                           if name not in ingress.models or ingress.models[name].started]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        card = ingress.model_cards.get(model_id)
        if card is None:
            raise APIErrorException(APIError(404, f"the model '{echo(model_id)}' does not exist",
                                             "invalid_request_error", "model", "model_not_found"))
        await probed()
        model = ingress.models.get(model_id)
        if model is not None and not model.started:
            return error_response(refusals.starting(model_id, 0.0))
        return card

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await ingress.handle_generation(request, CompletionRequest, "/v1/completions", "completions", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await ingress.handle_generation(request, ChatCompletionRequest, "/v1/chat/completions", "chat",
                                               "chatcmpl")

    @app.get("/v1/tr/stats")
    async def tr_stats():
        """Load of every live replica of each model (running/waiting requests, KV rows in use)."""
        ingress._ensure_monitor()
        names = sorted(ingress.models)

        async def one(name: str) -> list[dict]:
            try:
                results = await ingress.models[name].handle.broadcast("engine_stats").results_async(
                    timeout_s=PROBE_TIMEOUT_S, return_exceptions=True)
            except Exception as e:
                return [{"model": name, "error": f"unavailable: {type(e).__name__}"}]
            return [r if isinstance(r, dict) else {"model": name, "error": type(r).__name__} for r in results]

        data = [entry for entries in await asyncio.gather(*[one(n) for n in names]) for entry in entries]
        ingress.count("", "/v1/tr/stats", 200)
        return {"object": "list", "data": data}

    return app
