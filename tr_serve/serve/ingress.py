"""``OpenAIIngress``: the HTTP edge. FastAPI app with the OpenAI routes, API-key auth, request
validation in OpenAI's error shape, routing by ``model`` to the model server deployments (one
``DeploymentHandle`` per served model id) and SSE framing of their streamed chunks.

No model and no torch here: the ingress only parses, routes and frames.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tr_serve.serve.protocol import (APIError, APIErrorException, ChatCompletionRequest, CompletionRequest,
                                     error_type_for, new_id, validation_error)

logger = logging.getLogger("ray.serve")


ENDPOINTS = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/tr/stats"})


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers or None)


class APIKeyMiddleware:
    """Pure ASGI: every path but ``/health`` needs ``Authorization: Bearer <key>`` when keys are set.
    Runs before the body is read, so an unauthenticated request learns nothing else."""

    def __init__(self, app, keys: list[str], on_reject=None):
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.on_reject = on_reject

    def _ok(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                token = token.strip()
                if scheme.lower() != b"bearer" or not token:
                    return False
                # compare against every key so the time does not depend on which one matched
                return any([hmac.compare_digest(token, k) for k in self.keys])
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys and not scope.get("path", "").endswith("/health") \
                and not self._ok(scope):
            err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            if self.on_reject is not None:
                self.on_reject(scope.get("path", ""))
            await error_response(err)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _overloaded(e: BackPressureError) -> APIError:
    retry = e.retry_after_s if e.retry_after_s is not None else 1.0
    status = e.status_code if e.status_code in (429, 503) else 503
    return APIError(status, f"the server is overloaded, retry later ({e.message})", error_type_for(status),
                    None, "overloaded", {"Retry-After": str(max(1, math.ceil(retry)))})


def _unavailable(e: BaseException) -> APIError:
    return APIError(503, f"the model server is unavailable, retry later: {type(e).__name__}",
                    "service_unavailable_error", None, "unavailable", {"Retry-After": "5"})


@serve.ingress()
class OpenAIIngress:
    """``llm_deployments`` maps served model ids to model server deployments (handles at run time);
    ``model_cards`` holds the ``/v1/models`` entry of each."""

    def __init__(self, llm_deployments: dict, model_cards: dict[str, dict], api_keys: Optional[list[str]] = None):
        from tr_serve.serve.config import env_api_keys
        from tr_serve.serve.metrics import IngressMetrics

        self.handles = dict(llm_deployments)
        self.stream_handles = {k: h.options(stream=True) for k, h in self.handles.items()}
        self.model_cards = dict(model_cards)
        # keys given at build time, plus the env var as this replica sees it
        self.api_keys = sorted(set(api_keys or []) | set(env_api_keys()))
        self.metrics = IngressMetrics()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi_app(self)

    # ---- helpers ----------------------------------------------------------------------------
    def count(self, model: str, endpoint: str, status: int | str) -> None:
        try:
            self.metrics.request(model if model in self.handles else "",
                                 endpoint if endpoint in ENDPOINTS else "other", status)
        except Exception:  # metrics never fail a request
            logger.debug("metrics failed", exc_info=True)

    def _handle(self, body, endpoint: str):
        if body.model not in self.handles:
            self.count("", endpoint, 404)
            raise APIErrorException(APIError(
                404, f"the model '{body.model}' does not exist; available: {sorted(self.handles)}",
                "invalid_request_error", "model", "model_not_found"))
        return self.handles[body.model], self.stream_handles[body.model]

    async def generate(self, body, endpoint: str, method: str, id_prefix: str):
        handle, stream_handle = self._handle(body, endpoint)
        request_id = new_id(id_prefix)
        model = body.model
        if not body.stream:
            try:
                result = await getattr(handle, method).remote(body, request_id)
            except BackPressureError as e:
                result = _overloaded(e)
            except DeploymentUnavailableError as e:
                result = _unavailable(e)
            except asyncio.CancelledError:
                self.count(model, endpoint, 499)
                raise
            except Exception as e:
                result = self._remote_failure(e)
            if isinstance(result, APIError):
                self.count(model, endpoint, result.status_code)
                return error_response(result)
            self.count(model, endpoint, 200)
            return JSONResponse(result)

        gen = getattr(stream_handle, method + "_stream").remote(body, request_id)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = APIError(500, "the model server returned nothing", "server_error")
        except BackPressureError as e:
            first = _overloaded(e)
        except DeploymentUnavailableError as e:
            first = _unavailable(e)
        except asyncio.CancelledError:
            gen.cancel()
            self.count(model, endpoint, 499)
            raise
        except Exception as e:
            first = self._remote_failure(e)
        if isinstance(first, APIError):
            gen.cancel()
            self.count(model, endpoint, first.status_code)
            return error_response(first)
        return StreamingResponse(self._sse(first, gen, model, endpoint), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _remote_failure(self, e: BaseException) -> APIError:
        import ray.exceptions

        if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
            return _unavailable(e)
        logger.exception("tr_serve: request to the model server failed")
        return APIError(500, f"internal error: {type(e).__name__}", "server_error")

    async def _sse(self, first, gen, model: str, endpoint: str):
        """``data: {json}`` per chunk, then ``data: [DONE]``. Leaving early (client gone) cancels
        the handle's generator, which aborts the request in the engine."""
        status: int = 499
        done = False
        try:
            yield f"data: {_json(first)}\n\n"
            async for item in gen:
                if isinstance(item, APIError):
                    status = item.status_code
                    yield f"data: {_json(item.body())}\n\n"
                    break
                yield f"data: {_json(item)}\n\n"
            else:
                status = 200
            yield "data: [DONE]\n\n"
            done = True
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # the stream broke after the 200 went out: say so in-band
            err = _overloaded(e) if isinstance(e, BackPressureError) else self._remote_failure(e)
            status = err.status_code
            yield f"data: {_json(err.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                gen.cancel()
            self.count(model, endpoint, status)


def build_fastapi_app(ingress: OpenAIIngress) -> FastAPI:
    app = FastAPI(title="tr_serve", description="OpenAI-compatible API of a Token Recycling engine",
                  docs_url=None, redoc_url=None, openapi_url=None)
    if ingress.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=ingress.api_keys,
                           on_reject=lambda path: ingress.count("", path, 401))

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
        err = APIError(status, str(exc.detail), error_type_for(status), None, None, dict(exc.headers or {}))
        return error_response(err)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        logger.exception("tr_serve: unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", "server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models():
        ingress.count("", "/v1/models", 200)
        return {"object": "list", "data": list(ingress.model_cards.values())}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        card = ingress.model_cards.get(model_id)
        if card is None:
            raise APIErrorException(APIError(404, f"the model '{model_id}' does not exist", "invalid_request_error",
                                             "model", "model_not_found"))
        return card

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await ingress.generate(body, "/v1/completions", "completions", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await ingress.generate(body, "/v1/chat/completions", "chat", "chatcmpl")

    @app.get("/v1/tr/stats")
    async def tr_stats():
        """Load of one replica per model (running/waiting requests, KV rows in use)."""
        names = sorted(ingress.handles)
        results = await asyncio.gather(*[ingress.handles[n].engine_stats.remote() for n in names],
                                       return_exceptions=True)
        data = []
        for name, r in zip(names, results):
            data.append(r if isinstance(r, dict) else {"model": name, "error": f"{type(r).__name__}: {r}"})
        return {"object": "list", "data": data}

    return app
