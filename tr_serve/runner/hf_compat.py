"""The transformers API differences the runner depends on, told apart by feature, not by version.

Why: the project pins transformers >= 5.24, the GPU image carries 5.17, and between them the
decoder's ``forward`` renamed its cache argument from ``past_key_values`` to ``cache``. Both
forwards take ``**kwargs``, so the name a version does not know is swallowed there and the model
builds a cache of its own: the runner's forward then fails on its mask, and a call without a mask
(the matrix prior's) silently attends without its prefix. The keyword is therefore read off the
forward's signature of the model in hand.

The cache-layer contract that ``SlotKVCache`` implements (``CacheLayerMixin``'s abstract methods
and the arguments ``Cache`` passes them) is the same in 5.17 and 5.24+: nothing to tell apart
there (tests/runner/test_hf_compat.py checks it against the installed version).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

# the names the decoder forward has used for its cache argument, newest first
CACHE_KEYWORDS = ("cache", "past_key_values")


def cache_keyword(module: Any) -> str:
    """The keyword under which the forward of ``module`` (a transformers model or decoder, or its
    class) takes its KV cache: ``cache`` (transformers >= 5.24) or ``past_key_values`` (earlier)."""
    return _forward_cache_keyword(module if isinstance(module, type) else type(module))


@functools.lru_cache(maxsize=None)
def _forward_cache_keyword(cls: type) -> str:
    params = inspect.signature(getattr(cls, "forward")).parameters  # follows functools.wraps of decorators
    for name in CACHE_KEYWORDS:
        if name in params:
            return name
    raise TypeError(f"{cls.__name__}.forward takes its KV cache under none of {CACHE_KEYWORDS} "
                    f"(parameters: {list(params)}): a transformers version this runner does not know")


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for a call of ``module`` (see :func:`cache_keyword`)."""
    return {cache_keyword(module): cache}

