"""Append generated tokens one at a time and decide exactly where plain decoding would stop."""

from __future__ import annotations

from typing import Iterable

from tr_serve.engine.request import FinishReason, Request


def append_token(req: Request, token: int, eos_ids: Iterable[int], context_full: bool = False) -> bool:
    """Add ``token`` to ``req``'s output; returns True if the request is now finished.

    A verification step can emit several tokens; the caller feeds them in order and drops the rest
    as soon as this returns True, so an accepted path that crosses a stop point is cut where a
    one-token-at-a-time decoder would have stopped.
    """
    req.output_ids.append(token)
    before = len(req.text)
    req.text += req.detokenizer.add(token)
    params = req.params
    if not params.ignore_eos and token in eos_ids:
        req.finish_reason = FinishReason.STOP
    elif params.stop and _cut_at_stop_string(req, before):
        req.finish_reason = FinishReason.STOP
        return True
    elif len(req.output_ids) >= params.max_tokens or context_full:
        req.finish_reason = FinishReason.LENGTH
    else:
        return False
    req.text += req.detokenizer.flush()
    return True


def _cut_at_stop_string(req: Request, before: int) -> bool:
    longest = max(len(s) for s in req.params.stop)
    window_start = max(0, before - longest + 1)
    hits = [i for s in req.params.stop if (i := req.text.find(s, window_start)) >= 0]
    if not hits:
        return False
    req.text = req.text[: min(hits)]
    return True
