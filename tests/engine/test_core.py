"""The engine contract (engine/core.py): ``Engine`` and ``AsyncEngine`` answer the same handle
(matrix, load, health, shutdown), and a runner with remote workers is pinged and released through it."""

from __future__ import annotations

import pytest

from tiny_model import tiny_loaded
from tr_serve.engine.async_engine import AsyncEngine
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.core import RemoteRunner
from tr_serve.engine.engine import Engine
from tr_serve.runner.model_runner import ModelRunner
from tr_serve.sampling_params import SamplingParams


class _RemoteRunner(ModelRunner):
    """An in-process runner that counts what the engine asks of a remote one."""

    pings = 0
    closed = 0

    def check_health(self) -> None:
        self.pings += 1

    def shutdown(self) -> None:
        self.closed += 1


def _engine(tokenizer, remote: bool = False) -> Engine:
    loaded = tiny_loaded(tokenizer)
    config = EngineConfig(model="tiny", tree="top4", max_num_seqs=2, max_model_len=64)
    runner = (lambda max_len: _RemoteRunner(loaded.model, 2, max_len)) if remote else None
    return Engine(loaded, config, runner=runner)


def test_engine_handle_of_an_in_process_engine(tokenizer):
    engine = _engine(tokenizer)
    assert not isinstance(engine.runner, RemoteRunner)
    engine.check_health()
    engine.shutdown()  # nothing to release: the engine still serves
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), "a")
    assert engine.load().as_dict() == {"running": 0, "prefilling": 0, "waiting": 1, "kv_rows_used": 0, "kv_rows": 2,
                                       "prefix_cache_queries": 0, "prefix_cache_hits": 0}
    while engine.has_unfinished():
        engine.step()
    assert engine.load().kv_rows_used == 0 and engine.matrix.num_filled_rows() > 0


def test_remote_runner_is_pinged_and_released_through_the_async_engine(tokenizer):
    core = _engine(tokenizer, remote=True)
    engine = AsyncEngine(core)
    try:
        assert engine.matrix is core.matrix and engine.config is core.config and engine.tokenizer is tokenizer
        engine.check_health()
        assert core.runner.pings == 1
        assert engine.stats() == core.load().as_dict() and engine.num_running == 0 and engine.num_waiting == 0
    finally:
        engine.shutdown()
    assert core.runner.closed == 1
    with pytest.raises(RuntimeError, match=r"engine stopped \(step thread gone\)"):
        engine.check_health()
