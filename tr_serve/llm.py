"""Offline entry point: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from typing import Sequence

from tr_serve.engine.config import DEFAULT_MODEL, EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.engine.prompt import Prompt, encode_prompt
from tr_serve.engine.request import RequestOutput
from tr_serve.model_loader import LoadedModel, load_model
from tr_serve.sampling_params import SamplingParams
from tr_serve.tr.tree_spec import DEFAULT_TREE_SETTING

__all__ = ["LLM"]


class LLM:
    """Loads the model once; the engine (and its adjacency matrix) outlives every generate call."""

    def __init__(self, model: str = DEFAULT_MODEL, tree: str = DEFAULT_TREE_SETTING, k: int = 8,
                 loaded: LoadedModel | None = None, **engine_kwargs):
        self.config = EngineConfig(model=model, tree=tree, k=k, **engine_kwargs)
        self.loaded = loaded or load_model(model, device=self.config.device, dtype=self.config.dtype)
        self.tokenizer = self.loaded.tokenizer
        self.engine = Engine(self.loaded, self.config)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        params = params or SamplingParams()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (dict, int))):
            prompts = [prompts]
        ids = [self.engine.add_request(encode_prompt(self.tokenizer, p), params) for p in prompts]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
