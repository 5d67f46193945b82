"""Request preparation (serve/prepare.py) without Ray: the prompt's ids, SamplingParams, and the
OpenAI 400 naming the field at fault, from the engine layer's typed errors."""

from __future__ import annotations

import pytest

from tr_serve.engine.errors import InvalidRequestError, PromptTooLongError
from tr_serve.engine.prompt import check_prompt, encode_prompt
from tr_serve.sampling_params import SamplingParams
from tr_serve.serve.prepare import PreparedRequest, prepare_request
from tr_serve.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "Hi"}]
V, LIMIT = 49152, 64


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, **fields})


def _completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **fields})


def test_a_chat_request_becomes_the_templated_ids_and_openai_defaults(tokenizer):
    out = prepare_request(_chat(), tokenizer, V, LIMIT)
    assert isinstance(out, PreparedRequest)
    assert out.prompt_ids == encode_prompt(tokenizer, CHAT)
    n = len(out.prompt_ids)
    assert out.params == SamplingParams(max_tokens=LIMIT - n, temperature=1.0)


def test_sampling_fields_map_onto_sampling_params(tokenizer):
    out = prepare_request(_completion(max_tokens=5, temperature=1e-9, top_k=V, top_p=0.5, seed=3, stop="x",
                                      ignore_eos=True), tokenizer, V, LIMIT)
    assert out.params == SamplingParams(max_tokens=5, temperature=0.0, top_k=0, top_p=0.5, seed=3, stop=("x",),
                                        ignore_eos=True)


@pytest.mark.parametrize("request_, param, code", [
    (_completion(stop=[""]), "stop", None),
    (_completion(prompt=[1, 10**9]), "prompt", None),
    (_completion(prompt="word " * 100), "prompt", "context_length_exceeded"),
    (_chat(messages=[{"role": "user", "content": "word " * 100}]), "messages", "context_length_exceeded"),
    (_chat(max_completion_tokens=LIMIT), "max_completion_tokens", "context_length_exceeded"),
    (_chat(n=2), "n", "unsupported_value"),
])
def test_bad_requests_name_the_field(tokenizer, request_, param, code):
    err = prepare_request(request_, tokenizer, V, LIMIT)
    assert isinstance(err, APIError) and err.status_code == 400
    assert (err.param, err.code) == (param, code), err


def test_typed_errors_carry_the_field():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(top_p=0.0)
    assert e.value.param == "top_p" and str(e.value).startswith("top_p must")
    with pytest.raises(PromptTooLongError) as e:
        check_prompt([1, 2, 3], 3, "messages")
    assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        check_prompt([], 3)


def test_an_omitted_max_tokens_is_bounded_by_the_configured_ceiling(tokenizer):
    out = prepare_request(_chat(), tokenizer, V, LIMIT, default_max_tokens=7)
    assert isinstance(out, PreparedRequest) and out.params.max_tokens == 7
    out = prepare_request(_completion(max_tokens=20), tokenizer, V, LIMIT, default_max_tokens=7)
    assert out.params.max_tokens == 20  # a request's own max_tokens is its own
