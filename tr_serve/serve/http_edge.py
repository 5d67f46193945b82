"""The HTTP plumbing under the ingress's routes: OpenAI error bodies as ASCII JSON, the SSE
response, and the two pure-ASGI middlewares (API keys, the rewrite of any non-JSON error into an
OpenAI error body). No routes and no model here."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from tr_serve.serve.protocol import APIError, echo, error_type_for
from tr_serve.serve.tenants import TenantDirectory

logger = logging.getLogger("ray.serve")

TENANT_STATE = "tr_tenant"  # request.state key of the caller's tenant id
# request.state key of the caller's key or key group (a hashed id, never the key): what a per-key
# cap counts. The tenant id would not do: with `isolation: none` every key is the one shared tenant
CALLER_STATE = "tr_caller"
HEALTH_ROUTES = frozenset({"/health"})  # the only routes served without an API key
UNAVAILABLE_RETRY_AFTER_S = 5


def sse_json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ErrorJSONResponse(JSONResponse):
    """ASCII JSON: an error body renders whatever a message holds (a lone surrogate included)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(err: APIError) -> JSONResponse:
    return ErrorJSONResponse(err.body(), status_code=err.status_code, headers=err.headers or None)


def route_path(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


class APIKeyMiddleware:
    """Pure ASGI: every route but the exact health routes needs ``Authorization: Bearer <key>``
    when keys are set. Runs before the body is read, so an unauthenticated request learns nothing
    else. The key's tenant (serve/tenants.py) goes into the request's state as :data:`TENANT_STATE`,
    its caller id as :data:`CALLER_STATE`: the id of its key or key group in ``callers`` (a directory
    with isolation on), or the tenant id when ``callers`` is None (the two are the same then)."""

    def __init__(self, app, tenants: TenantDirectory, on_reject=None, callers: TenantDirectory | None = None):
        self.app = app
        self.tenants = tenants
        self.callers = callers
        self.on_reject = on_reject

    def _token(self, scope) -> bytes | None:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                token = token.strip()
                if scheme.lower() != b"bearer" or not token:
                    return None
                return token
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and route_path(scope) not in HEALTH_ROUTES:
            token = self._token(scope)
            tenant = self.tenants.tenant_of(token) if token is not None else None
            if token is None or tenant is None:
                err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                               "authentication_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                if self.on_reject is not None:
                    self.on_reject(route_path(scope))
                await error_response(err)(scope, receive, send)
                return
            state = scope.setdefault("state", {})
            state[TENANT_STATE] = tenant
            state[CALLER_STATE] = tenant if self.callers is None else self.callers.tenant_of(token) or tenant
        await self.app(scope, receive, send)


class OpenAIErrorMiddleware:
    """Pure ASGI, outermost: an error response that is not JSON (Serve's own backpressure handler,
    Starlette's plain-text errors) is rewritten as an OpenAI error body with the same status and
    ``Retry-After``; an exception that escapes before the response started becomes a 500 body."""

    MAX_BODY = 64 * 1024

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] = {}
        started = False

        async def guarded_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                status = message["status"]
                ctype = b""
                for k, v in message.get("headers", ()):
                    if k.lower() == b"content-type":
                        ctype = v.lower()
                if status >= 400 and not ctype.startswith(b"application/json"):
                    held["start"], held["body"] = message, b""
                    return
                started = True
                await send(message)
            elif message["type"] == "http.response.body" and "start" in held:
                if len(held["body"]) < self.MAX_BODY:
                    held["body"] += message.get("body", b"")
                if not message.get("more_body", False):
                    await self._send_rewritten(held.pop("start"), held.pop("body"), scope, receive, send)
                    started = True
            else:
                await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        except Exception:
            if started:
                raise
            logger.exception("tr_serve: unhandled error")
            await error_response(APIError(500, "internal server error", "server_error"))(scope, receive, send)

    @staticmethod
    async def _send_rewritten(start, body: bytes, scope, receive, send):
        status = start["status"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in start.get("headers", ())}
        text = body.decode("utf-8", errors="replace").strip() or "error"
        code = {429: "overloaded", 503: "unavailable", 413: "request_too_large", 404: "not_found",
                405: "method_not_allowed"}.get(status)
        keep = {k: v for k, v in headers.items() if k in ("retry-after", "www-authenticate", "allow")}
        if status in (429, 503) and "retry-after" not in keep:
            keep["retry-after"] = str(UNAVAILABLE_RETRY_AFTER_S)
        err = APIError(status, echo(text, 300), error_type_for(status), None, code, keep)
        await error_response(err)(scope, receive, send)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always runs ``on_close`` once it is done with, including when the
    client left before the body iterator started (whose ``finally`` then never runs)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]  # our bodies are async generators
            except Exception:  # already closed or still being closed by its own task
                pass
            self._on_close()
