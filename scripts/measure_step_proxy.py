"""The step on a narrow-deep model: where per-operation overhead is nearly all of a step.

A random Llama 80 layers deep (70B's depth) and 64 wide, one row, float32: each step's arithmetic
is tiny, so its time is what each operation costs to dispatch, as at one row on a GPU. Prints the
median time of a plain step (1 query token) and of a tree-2.2.2 step (81 query tokens) through
the runner's ``verify_step``, their ratio, the first call of each (a compile where ``--compile``),
and the top-level ATen operations per layer of one plain step (torch profiler: ATen events
with no ATen event above them).

    python scripts/measure_step_proxy.py                                 # the runner the factory picks
    python scripts/measure_step_proxy.py --decoder compact [--compile]   # the compact decoder

To compare with another commit, run this file with that commit's checkout first on
``PYTHONPATH`` and no ``--decoder`` (a commit without the setting).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 32000, 64, 224, 4, 1
PROMPT = 100  # tokens in the row before the timed steps
MAX_LEN = 1024


def top_level_aten_ops(events) -> int:
    """ATen events of a profile that no other ATen event encloses."""
    count = 0
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += parent is None
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decoder", default=None, help="compact or transformers (default: the factory's choice)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tree", default="2.2.2")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    from tr_serve.runner import factory
    from tr_serve.runner.llama_body import use_transformers_forward
    from tr_serve.runner.step_io import StepSampling
    from tr_serve.tr.tree import compile_tree, load_template

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=args.layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=MAX_LEN * 4)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    use_transformers_forward(model)  # transformers' layers, as GPUs ran them before the compact decoder
    kwargs = {} if args.decoder is None else {"decoder": args.decoder, "compile": args.compile}
    runner = factory.local_runner(model, MAX_LEN, 1, cpu_kernels="torch", **kwargs)
    row, sampling = torch.tensor([0]), StepSampling((None,), 8)
    runner.prefill_step(row, [list(range(10, 10 + PROMPT))], sampling)
    tree = compile_tree(load_template(args.tree, 8)[1])
    q = tree.num_nodes + 1
    plain = (torch.tensor([[5]]), torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool))
    drafted = (torch.randint(10, VOCAB, (1, q), generator=torch.Generator().manual_seed(1)), tree.depths, tree.mask)

    def timed(tokens, depths, mask) -> tuple[float, float]:
        """first call (s), median of the repeats (ms); the row's length stays (nothing is committed)."""
        t0 = time.perf_counter()
        runner.verify_step(row, tokens, depths, mask, None, sampling)
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            runner.verify_step(row, tokens, depths, mask, None, sampling)
            times.append(time.perf_counter() - t0)
        return first, statistics.median(times) * 1e3

    first_plain, plain_ms = timed(*plain)
    first_tree, tree_ms = timed(*drafted)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.verify_step(row, *plain, None, sampling)
    ops = top_level_aten_ops(prof.events())
    print(f"runner {type(runner).__name__} decoder={args.decoder} compile={args.compile}: plain {plain_ms:.2f} ms, "
          f"tree({q}) {tree_ms:.2f} ms, tree/plain {tree_ms / plain_ms:.2f}, first calls {first_plain:.1f} s / "
          f"{first_tree:.1f} s, top-level ATen ops per layer {ops / args.layers:.1f}", flush=True)


if __name__ == "__main__":
    main()
