"""Prompts into token ids, and the check that a prompt can be served at all.

One place for the offline ``LLM``, the server's request preparation, the CLI and the benches.
"""

from __future__ import annotations

from typing import Union

from tr_serve.engine.errors import InvalidRequestError, PromptTooLongError

ChatMessages = list[dict[str, str]]
Prompt = Union[str, ChatMessages, list[int]]


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Text is tokenized as is; a list of ``{"role", "content"}`` messages goes through the model's
    chat template with the assistant turn opened; a list of ints is taken as token ids."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    raise TypeError("a prompt is a string, a list of chat messages, or a list of token ids")


def check_prompt(prompt_ids: list[int], max_model_len: int, param: str = "prompt") -> None:
    """Raise for a prompt that can never be served: empty, or leaving no room for one token.
    ``param`` names the request field the prompt came from (``prompt`` or ``messages``)."""
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param)
    if n >= max_model_len:
        raise PromptTooLongError(f"the prompt has {n} tokens; this model's maximum context length is "
                                 f"{max_model_len} tokens and at least one token must be generated", param)
