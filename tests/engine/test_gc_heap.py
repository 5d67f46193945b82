"""The long-lived heap is frozen once per process, before the first engine's own objects."""

from __future__ import annotations

import gc
import weakref

from tiny_model import tiny_loaded
from tr_serve.engine import gc_heap
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine


def test_freezes_once_after_a_collection(monkeypatch):
    calls = []
    monkeypatch.setattr(gc_heap, "_frozen", False)
    monkeypatch.setattr(gc_heap.gc, "collect", lambda *a: calls.append("collect"))
    monkeypatch.setattr(gc_heap.gc, "freeze", lambda: calls.append("freeze"))
    assert gc_heap.freeze_long_lived_heap() is True
    assert gc_heap.freeze_long_lived_heap() is False
    assert calls == ["collect", "freeze"]


def test_the_first_engine_freezes_the_heap_and_later_cycles_are_still_collected(tokenizer, monkeypatch):
    calls = []
    monkeypatch.setattr(gc_heap, "_frozen", False)
    monkeypatch.setattr(gc_heap.gc, "freeze", lambda: calls.append("freeze"))
    config = EngineConfig(model="tiny", tree="top4", max_num_seqs=1, max_model_len=64)
    Engine(tiny_loaded(tokenizer), config)
    Engine(tiny_loaded(tokenizer), config)
    assert calls == ["freeze"]

    gc_heap.freeze_long_lived_heap()  # the real freeze (a no-op if this process already froze)

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle made after the freeze: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    gc.collect()
    assert dead() is None
