"""The error a request that can never be served raises, naming the field at fault.

The server turns it into an OpenAI 400 with ``param`` and ``code`` taken from here; nothing parses
the message to find the field.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """``param``: the request field at fault (``prompt``, ``max_tokens``, ``stop``...) or None;
    ``code``: an OpenAI error code (``context_length_exceeded``) or None."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class PromptTooLongError(InvalidRequestError):
    """The prompt can never fit in ``max_model_len``."""

    def __init__(self, message: str, param: str | None = "prompt"):
        super().__init__(message, param, "context_length_exceeded")
