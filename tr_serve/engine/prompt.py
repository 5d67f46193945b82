"""Prompts into token ids, and the check that a prompt can be served at all.

One place for the offline ``LLM``, the server's request preparation, the CLI and the benches.

A chat message's text is data, never markup: a special-token string inside it (``<|im_end|>``,
``<|im_start|>system``...) is tokenized as the plain text it is, so a message cannot close its own
turn or open another role's. Only the special tokens the chat template writes itself are encoded as
special tokens.
"""

from __future__ import annotations

import re
import secrets
import weakref
from typing import Union

from tr_serve.engine.errors import InvalidRequestError, PromptTooLongError

ChatMessages = list[dict[str, str]]
Prompt = Union[str, ChatMessages, list[int]]


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Text is tokenized as is; a list of ``{"role", "content"}`` messages goes through the model's
    chat template with the assistant turn opened, the messages' special-token strings encoded as
    plain text; a list of ints is taken as token ids."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        control = _control_tokens(tokenizer).pattern
        if any(control.search(v) for m in prompt for v in m.values() if isinstance(v, str)):
            return _encode_chat_as_text(tokenizer, prompt, control)
        # the common case: no message holds a special-token string, so the template's rendering is
        # tokenized in one piece, exactly as the model's own tokenizer does it
        return _chat_template_ids(tokenizer, prompt)
    raise TypeError("a prompt is a string, a list of chat messages, or a list of token ids")


def _chat_template_ids(tokenizer, messages: ChatMessages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


class _ControlTokens:
    """A tokenizer's control tokens (its special tokens, and the added tokens its chat template
    writes) as one pattern, longest first; and whether a piece from the middle of a text must be
    encoded after an anchor (tokenizers that mark the start of a text, like SentencePiece's prefix
    space, would mark every piece)."""

    def __init__(self, tokenizer):
        # a tokenizer with no template string or no added tokens (a stand-in) has no control tokens
        template = getattr(tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else ""
        tokens = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                  if t.content and not t.content.isspace() and (t.special or t.content in template)}
        alternatives = "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))
        self.pattern = re.compile(alternatives or "(?!)")  # (?!) matches nothing
        self.newline: list[int] = []
        self.anchored = False
        if tokens:  # without control tokens no message takes the piecewise path that needs these
            self.newline = _encode_text(tokenizer, "\n")
            self.anchored = _encode_text(tokenizer, "x") != self._after_newline(tokenizer, "x")

    def _after_newline(self, tokenizer, text: str) -> list[int] | None:
        ids = _encode_text(tokenizer, "\n" + text)
        n = len(self.newline)
        return ids[n:] if n and ids[:n] == self.newline else None


_CONTROL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _control_tokens(tokenizer) -> _ControlTokens:
    try:
        found = _CONTROL.get(tokenizer)
    except TypeError:  # not weakly referenceable: computed each time
        return _ControlTokens(tokenizer)
    if found is None:
        found = _CONTROL[tokenizer] = _ControlTokens(tokenizer)
    return found


def _encode_text(tokenizer, text: str) -> list[int]:
    """``text`` as plain text: no added token, special or not, is matched in it. The backend's
    pipeline is run directly, so no tokenizer-wide switch is flipped under concurrent callers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    splits = [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
    return [t.id for s in splits for t in backend.model.tokenize(s)]


def _encode_chat_as_text(tokenizer, messages: ChatMessages, control: re.Pattern) -> list[int]:
    """The chat template rendered with every special-token string in the messages replaced by a
    stand-in no request can guess; the rendering is tokenized piece by piece between stand-ins (the
    template's own special tokens recognized, as always), and each stand-in's string as plain text.
    The tokenizer splits a text at special tokens anyway, so the pieces tokenize as they would have
    around a special token, and decoding the ids gives the messages' text back."""
    nonce = secrets.token_hex(8)
    found: list[str] = []

    def stand_in(match: re.Match) -> str:
        found.append(match.group(0))
        return f"\x00{nonce}:{len(found) - 1}\x00"

    marked = [{k: control.sub(stand_in, v) if isinstance(v, str) else v for k, v in m.items()} for m in messages]
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    pieces = re.split(f"\x00{nonce}:(\\d+)\x00", rendered)
    if any(nonce in p for p in pieces[::2]):
        raise InvalidRequestError("this model's chat template alters the message text around a special-token "
                                  "string, so the string cannot be kept as plain text", "messages")
    state = _control_tokens(tokenizer)
    ids = list(tokenizer(pieces[0], add_special_tokens=False)["input_ids"])
    for i, piece in enumerate(pieces[1:], start=1):
        if i % 2:  # a stand-in: the message's special-token string, as plain text
            ids += _encode_middle(tokenizer, state, found[int(piece)], plain=True)
        elif piece:
            ids += _encode_middle(tokenizer, state, piece, plain=False)
    return ids


def _encode_middle(tokenizer, state: _ControlTokens, text: str, plain: bool) -> list[int]:
    """A piece from the middle of a rendering, as plain text or with special tokens recognized."""
    if plain:
        encode = lambda t: _encode_text(tokenizer, t)  # noqa: E731
    else:
        encode = lambda t: list(tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    if state.anchored:
        ids = encode("\n" + text)
        n = len(state.newline)
        if ids[:n] == state.newline:
            return ids[n:]
    return encode(text)


def check_prompt(prompt_ids: list[int], max_model_len: int, param: str = "prompt") -> None:
    """Raise for a prompt that can never be served: empty, or leaving no room for one token.
    ``param`` names the request field the prompt came from (``prompt`` or ``messages``)."""
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param)
    if n >= max_model_len:
        raise PromptTooLongError(f"the prompt has {n} tokens; this model's maximum context length is "
                                 f"{max_model_len} tokens and at least one token must be generated", param)
