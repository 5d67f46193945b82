"""The first-day GPU check: one command, nothing downloaded, random-weight models built from configs.

    python scripts/gpu_check.py                              # one GPU, <= 8 min (bfloat16)
    python scripts/gpu_check.py --bench-json bench_out/bench.json   # MAT from a `tr-serve bench` run
    python scripts/gpu_check.py --tiny --device cpu          # seconds; what the test suite runs

It needs only torch and transformers (the GPU machine: torch 2.11, transformers 5.17) plus this
repository. Three parts, printed as they finish and written as one JSON (``--json``):

1. **Forward latency by query tokens** (1, 2, 4, ..., 128) at contexts 512 and 2048, one row, for a
   Llama-3-8B-shaped model (32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336, vocab
   128256) in bfloat16 through the runner's verify path (``ModelRunner.verify``: the 4D tree mask,
   the slot KV cache, the LM head); median of ``--repeats`` timed calls after a warm-up, with
   ``torch.cuda.synchronize()`` around each.
2. **TR vs plain decoding at concurrency 1, 8 and 32 through the engine** (``Engine.step``) on the
   same model: the measured seconds per step of plain decoding (``tree: none``) and of each tree
   (``--trees``, whole template, ``budget: fixed``). A random-weight model accepts almost no draft
   tokens, so its own MAT says nothing about real text; the speedup is projected as
   ``MAT x (plain step time / TR step time)``, with the MAT measured on the Spec-Bench dev questions
   by ``tr-serve bench`` (``--bench-json``: the ``mat`` of its ``tr:<tree>`` methods), or given with
   ``--mat TREE=VALUE``, or else the single-stream figures of the README (SmolLM2-135M, 26 dev
   questions, CPU). The same projection from the latency table alone (concurrency 1: a forward of
   ``nodes + 1`` tokens vs one of 1 token, context 512) is reported beside it. The JSON records which
   MAT source was used.
3. **Losslessness on the device**: a small random Llama in the check's dtype; greedy TR (each tree)
   and plain decoding through the engine against ``model.generate`` (greedy), on ``--prompts``
   random prompts. It reports how often TR's tokens differ from plain decoding's (and plain's from
   ``generate``'s) and at which output position they first differ. In bfloat16, near-ties under
   different GEMM shapes (a 1-token vs an n-token forward) can flip an argmax: a few differences are
   expected there and are the point of measuring; in float32 on CPU there should be none.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
# README "Single stream" table: tr-serve bench --per-category 2 (26 Spec-Bench dev questions),
# SmolLM2-135M-Instruct, 128 new tokens, hot matrix, prompt seeding on
README_MAT = {"top2": 1.38, "top4": 1.53, "top8": 1.71, "2.2.2": 2.41}
QUERY_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (512, 2048)
CONCURRENCY = (1, 8, 32)


class StubTokenizer:
    """The engine detokenizes its outputs; random-weight models have no tokenizer (none is downloaded)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_llama(shape: dict, dtype: torch.dtype, device: torch.device, seed: int, init_range: float = 0.02):
    """A random-weight ``LlamaForCausalLM`` built straight on ``device`` (skeleton on meta first)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tr_serve.model_loader import LoadedModel

    config = LlamaConfig(**shape, initializer_range=init_range)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    model.to_empty(device=device)  # allocated once, in the check's dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * init_range)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.generation_config.eos_token_id = None  # like the engine here (no end-of-sequence id): fixed lengths
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model, StubTokenizer(), f"random-llama-{shape['hidden_size']}x{shape['num_hidden_layers']}",
                       ())


# ---- 1. latency table ----------------------------------------------------------------------------
def latency_table(loaded, device, contexts, query_tokens, repeats: int) -> dict:
    from tr_serve.runner.model_runner import ModelRunner

    runner = ModelRunner(loaded.model, 1, max(contexts) + max(query_tokens) + 8)
    row = torch.tensor([0])
    vocab = loaded.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    table = {}
    for ctx in contexts:
        runner.free(0)
        runner.prefill(row, [torch.randint(10, vocab, (ctx,), generator=gen).tolist()])
        table[str(ctx)] = {}
        for q in query_tokens:
            tokens = torch.randint(10, vocab, (1, q), generator=gen)
            depths, mask = torch.arange(q), torch.ones(q, q, dtype=torch.bool).tril()
            runner.verify(row, tokens, depths, mask)  # warm-up for the shape
            times = []
            for _ in range(repeats):
                sync(device)
                t0 = time.perf_counter()
                runner.verify(row, tokens, depths, mask)
                sync(device)
                times.append(time.perf_counter() - t0)
            table[str(ctx)][str(q)] = round(statistics.median(times) * 1e3, 3)
        print(f"  context {ctx}: " + ", ".join(f"q={q} {ms:.2f} ms" for q, ms in table[str(ctx)].items()), flush=True)
    del runner
    return table


# ---- 2. TR vs plain through the engine -----------------------------------------------------------
def run_engine(loaded, tree: str, concurrency: int, prompt_len: int, new_tokens: int, device: str, dtype: str,
               seed: int = 0, prompts: list[list[int]] | None = None) -> dict:
    from tr_serve.engine.config import EngineConfig
    from tr_serve.engine.engine import Engine
    from tr_serve.sampling_params import SamplingParams

    cfg = EngineConfig(model=loaded.model_id, tree=tree, k=8, max_num_seqs=concurrency,
                       max_model_len=prompt_len + new_tokens + 1, device=device, dtype=dtype, budget="fixed",
                       cpu_kernels="torch")
    engine = Engine(loaded, cfg)
    vocab = loaded.model.config.vocab_size
    if prompts is None:
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(10, vocab, (prompt_len,), generator=gen).tolist() for _ in range(concurrency)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=new_tokens, temperature=0.0)) for p in prompts]
    outputs, decode_s, decode_steps, nodes = {}, 0.0, 0, 0
    dev = torch.device(device)
    t_all = time.perf_counter()
    while engine.has_unfinished():
        decoding = bool(engine.running) and not engine.prefilling
        sync(dev)
        t0 = time.perf_counter()
        for out in engine.step():
            outputs[out.request_id] = out
        sync(dev)
        if decoding:  # steps that only verify (prefill steps excluded)
            decode_s += time.perf_counter() - t0
            decode_steps += 1
    wall = time.perf_counter() - t_all
    outs = [outputs[i] for i in ids]
    steps = sum(o.stats.verification_steps for o in outs)
    accepted = sum(sum(o.stats.accepted_per_step) for o in outs)
    nodes = [n for o in outs for n in o.stats.tree_nodes_per_step]
    return {"tokens": [o.token_ids for o in outs], "decode_steps": decode_steps,
            "step_ms": round(decode_s / decode_steps * 1e3, 3) if decode_steps else None,
            "mat": round(accepted / steps, 4) if steps else None, "tree_nodes": max(nodes) if nodes else 0,
            "wall_s": round(wall, 3), "new_tokens": sum(len(o.token_ids) for o in outs)}


def read_mat(args) -> tuple[dict[str, float], str]:
    mats = dict(README_MAT)
    source = "README single-stream table (tr-serve bench, SmolLM2-135M-Instruct, 26 Spec-Bench dev questions, CPU)"
    if args.bench_json:
        data = json.loads(Path(args.bench_json).read_text())
        found = {name.split(":", 1)[1]: m["mat"] for name, m in data.get("methods", {}).items()
                 if name.startswith("tr:") and m.get("mat")}
        if not found:
            raise SystemExit(f"{args.bench_json} has no tr:<tree> method with a MAT")
        mats.update(found)
        source = f"{args.bench_json} (tr-serve bench on the dev questions: methods tr:<tree>.mat)"
    for item in args.mat or []:
        tree, _, value = item.partition("=")
        mats[tree] = float(value)
        source = "--mat on the command line" + (f", else {source}" if len(mats) > 1 else "")
    return mats, source


def tr_vs_plain(loaded, args, device, dtype_name, table, mats, mat_source) -> dict:
    result = {"mat_source": mat_source, "projection": "speedup = MAT x plain step time / TR step time (measured "
              "here); table_speedup (concurrency 1) = MAT x latency(q=1) / latency(q=nodes+1) at context 512",
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "levels": {}}
    ctx_table = table.get(str(args.contexts[0]), {})
    for c in args.concurrency:
        level = {}
        plain = run_engine(loaded, "none", c, args.prompt_tokens, args.new_tokens, str(device), dtype_name)
        level["plain"] = {k: plain[k] for k in ("step_ms", "decode_steps", "wall_s", "new_tokens")}
        for tree in args.trees:
            tr = run_engine(loaded, tree, c, args.prompt_tokens, args.new_tokens, str(device), dtype_name)
            mat = mats.get(tree)
            entry = {k: tr[k] for k in ("step_ms", "decode_steps", "wall_s", "tree_nodes")}
            entry["mat_random_model"] = tr["mat"]
            entry["mat_dev"] = mat
            if mat and tr["step_ms"] and plain["step_ms"]:
                entry["speedup_projected"] = round(mat * plain["step_ms"] / tr["step_ms"], 3)
            q = tr["tree_nodes"] + 1
            lat = {int(k): v for k, v in ctx_table.items()}
            if c == 1 and mat and lat:
                big = min((k for k in lat if k >= q), default=max(lat))
                entry["table_speedup"] = round(mat * lat[min(lat)] / lat[big], 3)
                entry["table_query_tokens"] = big
            level[f"tr:{tree}"] = entry
        result["levels"][str(c)] = level
        print(f"  concurrency {c}: plain {plain['step_ms']} ms/step; " + "; ".join(
            f"{k} {v['step_ms']} ms/step ({v['tree_nodes']} nodes), projected {v.get('speedup_projected')}x"
            for k, v in level.items() if k != "plain"), flush=True)
    return result


# ---- 3. losslessness -----------------------------------------------------------------------------
def first_difference(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def losslessness(loaded, args, device, dtype_name) -> dict:
    vocab = loaded.model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, vocab, (args.lossless_prompt_tokens,), generator=gen).tolist()
               for _ in range(args.prompts)]
    n = args.lossless_new_tokens
    reference = []
    model = loaded.model
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
        reference.append(out[0, len(p):].tolist())
    plain = run_engine(loaded, "none", len(prompts), args.lossless_prompt_tokens, n, str(device), dtype_name,
                       prompts=prompts)
    report = {"prompts": len(prompts), "new_tokens": n, "model": dict(SMALL if not args.tiny else TINY),
              "plain_vs_generate": _compare(reference, plain["tokens"]), "trees": {}}
    for tree in args.trees:
        tr = run_engine(loaded, tree, len(prompts), args.lossless_prompt_tokens, n, str(device), dtype_name,
                        prompts=prompts)
        report["trees"][tree] = {"mat_random_model": tr["mat"], "tr_vs_plain": _compare(plain["tokens"], tr["tokens"]),
                                 "tr_vs_generate": _compare(reference, tr["tokens"])}
    print(f"  plain vs generate: {report['plain_vs_generate']['differing']}/{len(prompts)} differ; " + "; ".join(
        f"tr:{t} vs plain: {r['tr_vs_plain']['differing']}/{len(prompts)} differ "
        f"(first at {r['tr_vs_plain']['first_positions']}), MAT {r['mat_random_model']}"
        for t, r in report["trees"].items()), flush=True)
    return report


def _compare(reference, other) -> dict:
    positions = [first_difference(a, b) for a, b in zip(reference, other)]
    differing = [p for p in positions if p is not None]
    total = sum(len(a) for a in reference)
    return {"differing": len(differing), "rate": round(len(differing) / len(reference), 4) if reference else None,
            "first_positions": differing, "tokens_compared": total,
            "mean_first_position": round(statistics.mean(differing), 2) if differing else None}


# ---- main ----------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny models and shapes: seconds on a CPU (the test suite)")
    ap.add_argument("--trees", default="top4,top8,2.2.2", help="comma-separated tree templates")
    ap.add_argument("--mat", action="append", metavar="TREE=VALUE", help="MAT of a tree on the dev questions")
    ap.add_argument("--bench-json", help="a `tr-serve bench` JSON: the MAT of its tr:<tree> methods")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=512, help="engine part: prompt tokens per request")
    ap.add_argument("--new-tokens", type=int, default=32, help="engine part: new tokens per request")
    ap.add_argument("--prompts", type=int, default=16, help="losslessness: prompts")
    ap.add_argument("--lossless-new-tokens", type=int, default=64)
    ap.add_argument("--lossless-prompt-tokens", type=int, default=32)
    ap.add_argument("--json", default="bench_out/gpu_check.json")
    args = ap.parse_args(argv)
    args.trees = [t for t in args.trees.split(",") if t]
    args.contexts, args.query_tokens, args.concurrency = CONTEXTS, QUERY_TOKENS, CONCURRENCY
    if args.tiny:  # the same parts and report, smaller: contexts 64 and 256, one timed call per point
        args.contexts, args.repeats = (64, 256), 1
        args.prompt_tokens, args.new_tokens = min(args.prompt_tokens, 16), min(args.new_tokens, 8)
        args.prompts, args.lossless_new_tokens = min(args.prompts, 4), min(args.lossless_new_tokens, 16)
        args.lossless_prompt_tokens = min(args.lossless_prompt_tokens, 16)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu (and --tiny for seconds)")
    threads = torch.get_num_threads()
    if device.type == "cpu" and args.tiny:
        torch.set_num_threads(1)  # tiny shapes: more threads only contend
    try:
        return _run(args, device)
    finally:
        torch.set_num_threads(threads)


def _run(args, device: torch.device) -> dict:
    from tr_serve.model_loader import parse_dtype

    dtype = parse_dtype(args.dtype, device.type)
    dtype_name = str(dtype).removeprefix("torch.")
    mats, mat_source = read_mat(args)
    t_start = time.perf_counter()
    env = {"torch": torch.__version__, "device": str(device), "dtype": dtype_name, "tiny": args.tiny,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    import transformers

    env["transformers"] = transformers.__version__
    print(f"gpu_check: {env}", flush=True)
    result = {"env": env}

    shape = TINY if args.tiny else LLAMA3_8B
    print(f"1. forward latency by query tokens ({'tiny' if args.tiny else 'Llama-3-8B-shaped'}, {dtype_name})",
          flush=True)
    t0 = time.perf_counter()
    big = random_llama(shape, dtype, device, seed=0)
    result["latency_ms"] = {"model": shape, "repeats": args.repeats, "statistic": "median of timed verify calls",
                            "by_context": latency_table(big, device, args.contexts, args.query_tokens, args.repeats)}
    print(f"2. TR vs plain decoding through the engine, concurrency {list(args.concurrency)}", flush=True)
    result["tr_vs_plain"] = tr_vs_plain(big, args, device, dtype_name, result["latency_ms"]["by_context"], mats,
                                        mat_source)
    result["tr_vs_plain"]["seconds"] = round(time.perf_counter() - t0, 1)
    del big
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"3. losslessness of a small random model on {device} in {dtype_name} against generate", flush=True)
    small = random_llama(TINY if args.tiny else SMALL, dtype, device, seed=1, init_range=0.1)
    result["losslessness"] = losslessness(small, args, device, dtype_name)
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json} ({result['seconds']} s)", flush=True)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
