"""What the replica's message to its tensor-parallel ranks costs a step, on the narrow-deep model.

A random Llama 80 layers deep and 64 wide (4 heads, 2 KV heads: splits 2 ways) decodes one greedy
request through the replica's engine over 2 ranks (gloo, one thread each) with the compact decoder,
plain and with the 2.2.2 tree. Prints per decode step: the step's wall time at the replica, the
bytes of its call to the ranks and of rank 0's reply, and the round trip of an empty Ray call to
every rank (ping), as a share of the step: the part of each step that is the Ray call itself.

    python scripts/measure_tp_message.py [--tp 2] [--layers 80] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
SHAPE = dict(vocab_size=32000, hidden_size=64, intermediate_size=224, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=4096, tie_word_embeddings=False)


def _gpu_check():
    """scripts/gpu_check.py as a module (its random Llama and id tokenizer), shipped to the ranks by value."""
    spec = importlib.util.spec_from_file_location("gpu_check_for_tp_message", SCRIPTS / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--pings", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import ray

    from tr_serve.bench.local_ray import local_ray
    from tr_serve.engine.config import EngineConfig
    from tr_serve.tp.runner import tp_engine

    gc = _gpu_check()
    loaded = gc.random_llama(dict(SHAPE, num_hidden_layers=args.layers), torch.float32, torch.device("cpu"), seed=0)
    prompt = gc.random_prompts(1, 64, SHAPE["vocab_size"], seed=1)[0]
    with local_ray(args.tp + 1):
        for tree in ("none", "2.2.2"):
            config = EngineConfig(model=loaded.model_id, tree=tree, k=8, max_num_seqs=1, max_model_len=256,
                                  budget="fixed", cpu_kernels="torch", matrix_prior=False, decoder="compact")
            engine = tp_engine(loaded, config, args.tp, cpu_threads=1, measure_bytes=True)
            runner = engine.runner
            try:
                gc.submit(engine, prompt, args.new_tokens, None)
                engine.step()  # the prefill
                start = runner.transfer.forwards, runner.transfer.bytes_out, runner.transfer.bytes_back
                times = []
                while engine.has_unfinished():
                    t0 = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - t0)
                forwards = runner.transfer.forwards - start[0]
                out = (runner.transfer.bytes_out - start[1]) / forwards
                back = (runner.transfer.bytes_back - start[2]) / forwards
                pings = []
                for _ in range(args.pings):
                    t0 = time.perf_counter()
                    ray.get([w.ping.remote() for w in runner.workers])
                    pings.append(time.perf_counter() - t0)
                step, ping = statistics.median(times), statistics.median(pings)
                print(f"tp={args.tp} tree={tree}: step {step * 1e3:.2f} ms (median of {len(times)}), "
                      f"{out / 1e3:.1f} kB out and {back / 1e3:.1f} kB back per forward, Ray round trip to the "
                      f"ranks {ping * 1e3:.2f} ms = {100 * ping / step:.1f}% of the step", flush=True)
            finally:
                runner.shutdown()


if __name__ == "__main__":
    main()
