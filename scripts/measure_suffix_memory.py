"""Memory of the cross-request suffix index at its limit (``suffix_index_tokens``).

The index is filled past its capacity, so that it evicts and holds exactly what the limit allows,
with two kinds of text: the packaged dev questions' prompts (real text, many repeated grams; the
questions are fed in shuffled rounds until the limit is passed twice over) and random token ids
(every gram new: the most heads a token can cost). Reported per kind: tokens held, the index's own
count of its bytes (``SuffixIndex.nbytes``) and what ``tracemalloc`` saw the process allocate for
it, each per token held.

    .venv/bin/python scripts/measure_suffix_memory.py --capacity 262144
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tracemalloc

from tr_serve.data import SPEC_BENCH_DEV
from tr_serve.model_loader import load_model
from tr_serve.tr.suffix_index import DEFAULT_CAPACITY, SuffixIndex


def dev_documents(tokenizer) -> list[list[int]]:
    rows = [json.loads(line) for line in SPEC_BENCH_DEV.read_text().splitlines() if line.strip()]
    return [tokenizer.encode(turn) for row in rows for turn in row["turns"]]


def fill(documents, capacity: int) -> tuple[SuffixIndex, int]:
    """An index of ``capacity`` fed ``documents`` (an iterator) until twice its capacity went in;
    returns it and the bytes tracemalloc saw allocated meanwhile (still held)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = SuffixIndex(capacity)
    fed = 0
    for tokens in documents:
        doc = index.open()
        index.extend(doc, tokens)
        index.finish(doc)
        fed += len(tokens)
        if fed >= 2 * capacity:
            break
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return index, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=int, default=DEFAULT_CAPACITY, help="tokens (default: the engine's default)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer encodes the dev text")
    args = ap.parse_args()
    tokenizer = load_model(args.model).tokenizer
    dev = dev_documents(tokenizer)
    vocab = len(tokenizer)
    rng = random.Random(0)

    def dev_rounds():
        while True:
            order = dev[:]
            rng.shuffle(order)
            yield from order

    def random_text():
        while True:
            yield [rng.randrange(vocab) for _ in range(rng.randrange(64, 1024))]

    print(f"capacity {args.capacity} tokens; dev text: {len(dev)} prompts, {sum(map(len, dev))} tokens a round\n")
    print("| text | tokens held | documents | nbytes | nbytes / token | tracemalloc | tracemalloc / token |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, documents in (("dev questions", dev_rounds()), ("random ids", random_text())):
        index, traced = fill(documents, args.capacity)
        n = index.num_tokens
        print(f"| {name} | {n} | {index.num_documents()} | {index.nbytes() / 2**20:.1f} MiB | {index.nbytes() / n:.0f} B "
              f"| {traced / 2**20:.1f} MiB | {traced / n:.0f} B |")


if __name__ == "__main__":
    main()
