"""OpenAI response bodies of one request (plain dicts: they cross the handle and go straight to JSON).

``responses_for(request, ...)`` picks the shape from the request's type: a text completion
(``text_completion``, ``choices[0].text``) or a chat completion (``chat.completion`` /
``chat.completion.chunk``, ``choices[0].message`` / ``delta``), so the server writes one code path
for both endpoints.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from tr_serve.serve.protocol import ChatCompletionRequest, CompletionRequest, usage


class CompletionResponses:
    """The bodies of one ``/v1/completions`` request."""

    full_object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, created: int, include_usage: bool):
        self.request_id, self.model, self.created, self.include_usage = request_id, model, created, include_usage

    def choice(self, text: str, reason: Optional[str]) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    def delta_choice(self, text: str, reason: Optional[str]) -> dict[str, Any]:
        return self.choice(text, reason)

    def full(self, text: str, reason: Optional[str], prompt_tokens: int, completion_tokens: int,
             tr: dict[str, Any], cached_tokens: int = 0) -> dict[str, Any]:
        return {"id": self.request_id, "object": self.full_object, "created": self.created, "model": self.model,
                "choices": [self.choice(text, reason)],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens), "tr": tr}

    def first_chunk(self) -> Optional[dict[str, Any]]:
        """The chunk sent once the request is accepted, before any text (none for completions)."""
        return None

    def chunk(self, text: str, reason: Optional[str] = None, **extra: Any) -> dict[str, Any]:
        """A streamed chunk with the text new since the last one (``reason`` on the last chunk)."""
        return self._chunk(self.delta_choice(text, reason), **extra)

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        out = {"id": self.request_id, "object": self.chunk_object, "created": self.created, "model": self.model,
               "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        out.update(extra)
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage`` asked for it."""
        return {"id": self.request_id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


class ChatResponses(CompletionResponses):
    """The bodies of one ``/v1/chat/completions`` request."""

    full_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def choice(self, text: str, reason: Optional[str]) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}

    def delta_choice(self, text: str, reason: Optional[str]) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

    def first_chunk(self) -> Optional[dict[str, Any]]:
        """The role chunk: it goes out before the prefill."""
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})


def responses_for(request: Union[CompletionRequest, ChatCompletionRequest], request_id: str, model: str,
                  created: int) -> CompletionResponses:
    cls = ChatResponses if isinstance(request, ChatCompletionRequest) else CompletionResponses
    return cls(request_id, model, created, request.include_usage)
