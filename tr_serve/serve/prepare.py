"""An OpenAI request into an engine request: the prompt's token ids and its ``SamplingParams``.

Runs in the model server (which has the tokenizer), in a worker thread; no Ray here. A request the
engine could never serve comes back as the OpenAI error naming the field at fault: the engine
layer's checks (``check_prompt``, ``SamplingParams``) raise ``InvalidRequestError`` carrying the
field, so nothing parses a message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from tr_serve.engine.errors import InvalidRequestError
from tr_serve.engine.prompt import check_prompt, encode_prompt
from tr_serve.sampling_params import SamplingParams
from tr_serve.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request, echo

OpenAIRequest = Union[CompletionRequest, ChatCompletionRequest]
GREEDY_EPS = 1e-5  # a lower temperature would overflow the logits: greedy, as vLLM does


@dataclass(frozen=True)
class PreparedRequest:
    prompt_ids: list[int]
    params: SamplingParams


def prepare_request(request: OpenAIRequest, tokenizer, vocab_size: int, max_model_len: int,
                    default_max_tokens: int | None = None) -> Union[PreparedRequest, APIError]:
    """Validate and tokenize ``request``; an ``APIError`` (400) for one that cannot be served.
    ``default_max_tokens``: the ceiling of a request that sends no max_tokens (None: the context left)."""
    err = request.unsupported()
    if err is not None:
        return err
    ids = prompt_ids(request, tokenizer, vocab_size)
    if isinstance(ids, APIError):
        return ids
    try:
        check_prompt(ids, max_model_len, request.prompt_param)
        params = sampling_params(request, len(ids), max_model_len, vocab_size, default_max_tokens)
    except InvalidRequestError as e:
        return bad_request(echo(e, 300), e.param, e.code)
    except ValueError as e:  # not a field's fault
        return bad_request(echo(e, 300))
    return PreparedRequest(ids, params)


def prompt_ids(request: OpenAIRequest, tokenizer, vocab_size: int) -> Union[list[int], APIError]:
    """The request's prompt (text, token ids or chat messages) as token ids."""
    prompt = request.prompt_input()
    if isinstance(prompt, APIError):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            return bad_request(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                               request.prompt_param)
    try:
        return encode_prompt(tokenizer, prompt)
    except Exception as e:  # jinja TemplateError and friends: the messages do not fit the template
        return bad_request(f"{request.tokenize_failure}: {echo(e, 300)}", request.prompt_param)


def sampling_params(request: OpenAIRequest, prompt_len: int, max_model_len: int, vocab_size: int,
                    default_max_tokens: int | None = None) -> SamplingParams:
    """OpenAI's sampling fields as ``SamplingParams`` (OpenAI's defaults where a field is absent);
    raises ``InvalidRequestError`` naming the field."""
    n, limit = prompt_len, max_model_len
    max_tokens = request.requested_max_tokens()
    if max_tokens is None:  # the context left, at most the configured ceiling
        max_tokens = limit - n if default_max_tokens is None else min(limit - n, default_max_tokens)
    elif n + max_tokens > limit:
        param = request.max_tokens_param
        raise InvalidRequestError(f"this model's maximum context length is {limit} tokens; the prompt has {n} "
                                  f"tokens and {param} is {max_tokens} ({n + max_tokens} in all): lower {param} "
                                  "or shorten the prompt", param, "context_length_exceeded")
    top_k = request.top_k if request.top_k not in (None, -1) else 0
    if top_k >= vocab_size:  # keeps every token: the same as off
        top_k = 0
    temperature = 1.0 if request.temperature is None else float(request.temperature)  # OpenAI's default
    if temperature < GREEDY_EPS:
        temperature = 0.0
    return SamplingParams(
        max_tokens=max_tokens,
        stop=request.stop if request.stop is not None else (),
        ignore_eos=request.ignore_eos,
        temperature=temperature,
        top_p=1.0 if request.top_p is None else float(request.top_p),
        top_k=top_k,
        seed=request.seed,
    )
