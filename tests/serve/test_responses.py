"""The OpenAI response bodies (serve/responses.py) of both endpoints."""

from __future__ import annotations

from tr_serve.serve.protocol import ChatCompletionRequest, CompletionRequest
from tr_serve.serve.responses import ChatResponses, responses_for

TR = {"mat": 1.0}


def test_chat_bodies():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                                "stream_options": {"include_usage": True}})
    r = responses_for(req, "id1", "m", 7)
    assert isinstance(r, ChatResponses)
    assert r.full("hi", "stop", 3, 2, TR, cached_tokens=1) == {
        "id": "id1", "object": "chat.completion", "created": 7, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                  "prompt_tokens_details": {"cached_tokens": 1}}, "tr": TR}
    head = {"id": "id1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    assert r.first_chunk() == {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}], "usage": None}
    assert r.chunk("x") == {**head, "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None,
                                                 "finish_reason": None}], "usage": None}
    assert r.chunk("", "length", tr=TR)["choices"][0]["delta"] == {}
    assert r.usage_chunk(3, 2) == {**head, "choices": [],
                                   "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                             "prompt_tokens_details": {"cached_tokens": 0}}}


def test_completion_bodies():
    r = responses_for(CompletionRequest.model_validate({"model": "m", "prompt": "a"}), "id2", "m", 7)
    assert r.first_chunk() is None
    assert r.full("hi", "length", 1, 1, TR)["choices"] == [{"index": 0, "text": "hi", "logprobs": None,
                                                             "finish_reason": "length"}]
    assert r.full("hi", "length", 1, 1, TR)["object"] == "text_completion"
    chunk = r.chunk("", "stop", tr=TR)
    assert "usage" not in chunk and chunk["tr"] == TR and chunk["choices"][0]["text"] == ""
