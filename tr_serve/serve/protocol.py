"""OpenAI-compatible request models, error bodies and response helpers (no Ray, no torch).

Requests are validated strictly (``"5"`` is not an integer, ``"true"`` is not a boolean) and
unknown fields are ignored, as vLLM does. Fields OpenAI defines but this server cannot honour
(``logprobs``, ``tools``, ``tool_choice``, penalties, ...) are rejected with a 400 naming the field
rather than silently dropped.

Before a body reaches these models, ``check_json`` bounds its nesting depth and refuses lone UTF-16
surrogates (which no tokenizer or JSON encoder takes); ``echo`` is the only way a user-supplied
string gets into an error message: cut to ``ECHO_CHARS`` characters, anything unprintable escaped.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from tr_serve.engine.request_context import RequestContext

_INT64_MAX = 2**63 - 1
ECHO_CHARS = 64  # most characters of a user-supplied string an error message repeats
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000


# ---- errors ---------------------------------------------------------------------------------
@dataclass
class APIError:
    """An OpenAI-shaped error; the model server returns (never raises) these across the handle."""

    status_code: int
    message: str
    type: str = "invalid_request_error"
    param: Optional[str] = None
    code: Optional[str] = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def echo(value: Any, limit: int = ECHO_CHARS) -> str:
    """A user-supplied value as an error message may repeat it: at most ``limit`` characters, with
    unprintable characters (controls, lone surrogates) escaped, and the length said when cut."""
    text = value if isinstance(value, str) else str(value)
    short = text[:limit]
    out = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"
                  for c in short)
    if len(text) > limit:
        out += f"... ({len(text)} characters)"
    return out


def prompt_too_long(chars: int, limit: int, param: str) -> APIError:
    return bad_request(f"the prompt has {chars} characters; this server takes at most {limit} (max_prompt_chars) "
                       "before tokenizing", param, "context_length_exceeded")


def has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _path_param(path: tuple) -> str | None:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else ("." if out else "") + echo(p, 32)
    return out or None


def check_json(obj: Any, max_depth: int) -> APIError | None:
    """Walk a parsed JSON body without recursion: a 400 naming the place when it nests deeper
    than ``max_depth`` containers or holds a lone UTF-16 surrogate (in a key or a string)."""
    stack: list[tuple[Any, int, tuple]] = [(obj, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, (dict, list)):
            depth += 1
            if depth > max_depth:
                return bad_request(f"the request body nests more than {max_depth} levels of objects and arrays",
                                   _path_param(path[:4]), "invalid_body")
            if isinstance(value, dict):
                for k, v in value.items():
                    if has_lone_surrogate(k):
                        return bad_request("a key of the request body holds a lone UTF-16 surrogate (a "
                                           "\\ud800-\\udfff escape without its pair): send valid Unicode",
                                           _path_param(path), "invalid_unicode")
                    stack.append((v, depth, path + (k,)))
            else:
                stack.extend((v, depth, path + (i,)) for i, v in enumerate(value))
        elif isinstance(value, str) and has_lone_surrogate(value):
            return bad_request("the request holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its "
                               "pair): send valid Unicode", _path_param(path), "invalid_unicode")
    return None


def error_type_for(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 405: "invalid_request_error", 429: "rate_limit_error",
            503: "service_unavailable_error"}.get(status, "server_error" if status >= 500 else "invalid_request_error")


class APIErrorException(Exception):
    """Raised inside the ingress; turned into a JSON response by its exception handler."""

    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


def validation_param(loc: tuple | list) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("str", "list[str]", "list[int]", "list[list[int]]", "function-after", "union_tag"):
            continue  # union branch names pydantic puts in the location
        else:
            out += ("." if out else "") + echo(p, 32)
    return out or None


def validation_error(errors: list[dict]) -> APIError:
    """First pydantic error as an OpenAI 400 (``param`` names the field; malformed JSON has none)."""
    if not errors:
        return bad_request("invalid request body")
    err = errors[0]
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return bad_request(f"request body is not valid JSON: {detail}".rstrip(": "), None, "invalid_json")
    loc = tuple(err.get("loc", ()))
    param = validation_param(loc)
    if err.get("type") == "missing":
        if param is None:
            return bad_request("request body is missing: send a JSON object", None, "missing_body")
        return bad_request(f"missing required field '{param}'", param, "missing_required_parameter")
    if param is None and err.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return bad_request("request body must be a JSON object (Content-Type: application/json)", None,
                           "invalid_body")
    msg = err.get("msg", "invalid value")
    return bad_request(f"invalid value for '{param}': {msg}" if param else msg, param, "invalid_value")


# ---- requests -------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, protected_namespaces=())


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: StrictStr
    text: Optional[StrictStr] = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: Optional[StrictStr] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


class TROptions(BaseModel):
    """The request's ``tr`` extension object: switches of its own that can only take away.
    ``speculation: "off"`` decodes it plainly (the same output); ``learn: false`` keeps its prompt
    and output out of every index and matrix row."""

    model_config = ConfigDict(extra="forbid", strict=True)

    speculation: Literal["on", "off"] = "on"
    learn: bool = True


class _SamplingFields(_Strict):
    """Fields common to both endpoints."""

    model: StrictStr
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[StrictInt] = Field(default=None, ge=-1)  # vLLM extension; 0 or -1 = off
    seed: Optional[StrictInt] = Field(default=None, ge=0, le=_INT64_MAX)
    n: Optional[StrictInt] = Field(default=None, ge=1)
    ignore_eos: bool = False  # vLLM extension
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, Any]] = None
    user: Optional[StrictStr] = None
    tr: Optional[TROptions] = None  # tr_serve extension

    def request_context(self, base: RequestContext) -> RequestContext:
        """``base`` (the caller's tenant, from the ingress) with this body's ``tr`` switches."""
        if self.tr is None:
            return base
        return dataclasses.replace(base, speculation=base.speculation and self.tr.speculation == "on",
                                   learn=base.learn and self.tr.learn)

    def unsupported(self) -> APIError | None:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            return bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}", "stop",
                               "invalid_value")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            return bad_request(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop",
                               "invalid_value")
        if self.n is not None and self.n > 1:
            return bad_request("n > 1 is not supported", "n", "unsupported_value")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                return bad_request(f"{name} is not supported (use 0)", name, "unsupported_value")
        if self.logit_bias:
            return bad_request("logit_bias is not supported", "logit_bias", "unsupported_value")
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: Optional[StrictInt] = None
    best_of: Optional[StrictInt] = Field(default=None, ge=1)
    suffix: Optional[StrictStr] = None

    def unsupported(self) -> APIError | None:
        if self.echo:
            return bad_request("echo is not supported", "echo", "unsupported_value")
        if self.logprobs is not None:
            return bad_request("logprobs are not supported", "logprobs", "unsupported_value")
        if self.best_of is not None and self.best_of > 1:
            return bad_request("best_of > 1 is not supported", "best_of", "unsupported_value")
        if self.suffix:
            return bad_request("suffix is not supported", "suffix", "unsupported_value")
        return super().unsupported()

    def single_prompt(self) -> Union[str, list[int], APIError]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if len(p) == 0:
            return bad_request("prompt is empty", "prompt", "invalid_value")
        if all(isinstance(t, int) for t in p):
            return list(p)
        if len(p) == 1:  # a batch of one
            return p[0] if isinstance(p[0], str) else list(p[0])
        return bad_request("batched prompts are not supported: send one prompt per request", "prompt",
                           "unsupported_value")

    def prompt_chars(self) -> int:
        """Characters the tokenizer would see (a token id counts as one)."""
        p = self.prompt
        if isinstance(p, str):
            return len(p)
        return sum(len(x) if isinstance(x, (str, list)) else 1 for x in p)

    def prompt_input(self) -> Union[str, list[int], APIError]:
        """What the tokenizer takes (``encode_prompt``): text or token ids."""
        return self.single_prompt()

    @property
    def prompt_param(self) -> str:
        return "prompt"

    @property
    def tokenize_failure(self) -> str:
        return "could not tokenize the prompt"

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list[Any]] = None  # the deprecated form of tools
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[list[StrictStr]] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None

    def unsupported(self) -> APIError | None:
        if self.logprobs or self.top_logprobs:
            return bad_request("logprobs are not supported", "logprobs", "unsupported_value")
        if self.tools:
            return bad_request("tools are not supported", "tools", "unsupported_value")
        if self.tool_choice is not None and self.tool_choice != "none":  # "none" asks for what we do anyway
            return bad_request("tool_choice is not supported (tool calling is not available; \"none\" is "
                               "accepted)", "tool_choice", "unsupported_value")
        for name in ("functions", "function_call", "audio", "prediction", "web_search_options"):
            if getattr(self, name) is not None:
                return bad_request(f"{name} is not supported", name, "unsupported_value")
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            return bad_request("only the \"text\" modality is supported", "modalities", "unsupported_value")
        if self.response_format and self.response_format.get("type", "text") != "text":
            return bad_request("only response_format {\"type\": \"text\"} is supported", "response_format",
                               "unsupported_value")
        return super().unsupported()

    def chat_messages(self) -> list[dict[str, str]] | APIError:
        out = []
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
                return bad_request("only text content parts are supported", f"messages[{i}].content",
                                   "unsupported_value")
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text()})
        return out

    def prompt_chars(self) -> int:
        return sum(len(m.text()) + len(m.name or "") for m in self.messages)

    def prompt_input(self) -> Union[list[dict[str, str]], APIError]:
        """What the tokenizer takes (``encode_prompt``): the messages for the chat template."""
        return self.chat_messages()

    @property
    def prompt_param(self) -> str:
        return "messages"

    @property
    def tokenize_failure(self) -> str:
        return "the messages do not fit the model's chat template"

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses (plain dicts: they cross the handle and go straight to JSON) -------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the prefix cache held (not prefilled)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def model_card(model_id: str, created: int, max_model_len: int, root: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "tr_serve",
            "root": root, "max_model_len": max_model_len}
