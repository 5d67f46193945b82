"""Benchmarks: ``tr-serve bench`` compares Token Recycling with plain decoding and PLD on Spec-Bench.

One job per file:

* ``records``     -- questions read and selected, runs, per-method JSON entries (standard library only)
* ``questions``   -- the packaged question file, prompt encoding, the fleet benches' warm / measured split
* ``config``      -- ``BenchConfig`` of a single-stream run, validated before the model loads
* ``methods``     -- the methods compared and how each answers one question
* ``runner``      -- ``run_bench``: the interleaved run and its JSON
* ``summary``     -- per-method figures and their definitions
* ``report``      -- Markdown tables and the chart
* ``provenance``  -- versions, threads, kernel plan, template hashes recorded in every JSON
* ``spec_bench``  -- the command line of ``tr-serve bench``
* ``concurrency``, ``latency`` -- ``tr-serve bench --concurrency`` / ``--latency``
* ``fleet``       -- ``tr-serve bench-fleet``; ``tp``, ``tp_fleet`` -- ``tr-serve bench-tp`` / ``bench-tp-fleet``
"""

from tr_serve.bench.config import BenchConfig
from tr_serve.bench.records import BenchError
from tr_serve.bench.runner import run_bench

__all__ = ["BenchConfig", "BenchError", "run_bench"]
