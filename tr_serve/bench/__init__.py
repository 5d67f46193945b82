"""Benchmarks: ``tr-serve bench`` compares Token Recycling with plain decoding and PLD on Spec-Bench."""

from tr_serve.bench.spec_bench import BenchConfig, BenchError, run_bench

__all__ = ["BenchConfig", "BenchError", "run_bench"]
