"""Bad inputs for each compiled kernel's Python wrapper, run in a subprocess by test_kernel_inputs.py.

    python tests/kernels/kernel_bad_inputs.py GROUP

prints one JSON object: ``{"cases": {case: null | error class name}}`` (null: the call returned),
or ``{"unavailable": why}`` where the kernels are not available here (and not required). A wrapper
that lets a bad input reach its C code may crash the process (a segfault), which the test sees as
a failed run, not as the death of pytest. Each group's ``good`` case is a valid call: it must return,
so that the bad cases are shown to fail for their badness, not for an unusable kernel.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Callable

import torch

from tr_serve.bench import roofline
from tr_serve.kernels import layer_driver, layer_ops, native, panel_gemm, top_k, tree_attention

Cases = dict[str, Callable[[], object]]


def _rc(rc: int) -> None:
    """A direct C call's return code as an error (0 is success)."""
    if rc != 0:
        raise ValueError(f"the kernel returned {rc}")


def panel_gemm_cases() -> Cases:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g)
    p = panel_gemm.pack(w)  # [3, 24, 16]
    x = torch.randn(3, 24, generator=g)
    strided = torch.randn(3, 24, 32, generator=g)[:, :, ::2]  # [3, 24, 16], not contiguous
    lib = panel_gemm.KERNEL.get()
    y = torch.empty(3, 48)
    return {
        "good": lambda: panel_gemm.linear(x, p, 40),
        "empty batch": lambda: panel_gemm.linear(torch.randn(0, 24), p, 40),
        "empty batch with leading dims": lambda: panel_gemm.linear(torch.randn(2, 0, 24), p, 40),
        "no inputs (K = 0)": lambda: panel_gemm.linear(torch.randn(3, 0), panel_gemm.pack(torch.randn(40, 0)), 40),
        "float64 input": lambda: panel_gemm.linear(x.double(), p, 40),
        "int input": lambda: panel_gemm.linear(x.int(), p, 40),
        "a list, not a tensor": lambda: panel_gemm.linear(x.tolist(), p, 40),
        "K differs from the panels'": lambda: panel_gemm.linear(torch.randn(3, 23), p, 40),
        "panels not contiguous": lambda: panel_gemm.linear(x, strided, 40),
        "panels float64": lambda: panel_gemm.linear(x, p.double(), 40),
        "panels 2-D": lambda: panel_gemm.linear(x, p.reshape(3, -1), 40),
        "panels of 8 lanes": lambda: panel_gemm.linear(x, p.reshape(6, 24, 8), 40),
        "n past the panels": lambda: panel_gemm.linear(x, p, 49),
        "n short of the panels": lambda: panel_gemm.linear(x, p, 32),
        "n zero": lambda: panel_gemm.linear(x, p, 0),
        "the C function with no rows": lambda: _rc(lib.tr_panel_gemm(x.data_ptr(), 24, p.data_ptr(), y.data_ptr(),
                                                                       48, 0, 24, 3, 1)),
        "the C function with no threads": lambda: _rc(lib.tr_panel_gemm(x.data_ptr(), 24, p.data_ptr(),
                                                                          y.data_ptr(), 48, 3, 24, 3, 0)),
    }


def _attention_inputs(g: torch.Generator):
    keys, values = torch.randn(2, 2, 32, 16, generator=g), torch.randn(2, 2, 32, 16, generator=g)
    local = torch.tril(torch.ones(1, 3, 3, dtype=torch.bool))
    queries = tree_attention.step_queries([1], [5], [3], local)
    q = torch.randn(3, 4, 16, generator=g)
    return q, keys, values, local, queries


def tree_attention_cases() -> Cases:
    g = torch.Generator().manual_seed(1)
    q, keys, values, local, queries = _attention_inputs(g)
    sq = tree_attention.step_queries
    attend = tree_attention.attend
    empty = tree_attention.StepQueries(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                       torch.zeros(0, 3, dtype=torch.uint8))
    return {
        "good": lambda: attend(q, keys, values, queries, 0.25),
        "no query tokens": lambda: attend(q[:0], keys, values, empty, 0.25),
        "q float64": lambda: attend(q.double(), keys, values, queries, 0.25),
        "q 2-D": lambda: attend(q.reshape(3, 64), keys, values, queries, 0.25),
        "keys not contiguous": lambda: attend(q, keys.transpose(0, 1), values, queries, 0.25),
        "values of another shape": lambda: attend(q, keys, values[:, :, :16], queries, 0.25),
        "keys float64": lambda: attend(q, keys.double(), values, queries, 0.25),
        "head size differs from the cache's": lambda: attend(torch.randn(3, 2, 32), keys, values, queries, 0.25),
        "heads not a multiple of key/value heads": lambda: attend(torch.randn(3, 3, 16), keys, values, queries, 0.25),
        "head size not a multiple of 16": lambda: attend(torch.randn(3, 4, 8), keys[..., :8].contiguous(),
                                                         values[..., :8].contiguous(), queries, 0.25),
        "cache row past the cache": lambda: attend(q, keys, values, sq([2], [5], [3], local), 0.25),
        "negative cache row": lambda: attend(q, keys, values, sq([-1], [5], [3], local), 0.25),
        "prefix plus new slots past the row": lambda: attend(q, keys, values, sq([1], [30], [3], local), 0.25),
        "negative prefix": lambda: attend(q, keys, values, sq([1], [-4], [3], local), 0.25),
        "rows int32": lambda: attend(q, keys, values, queries._replace(rows=queries.rows.int()), 0.25),
        "prefix float": lambda: attend(q, keys, values, queries._replace(prefix=queries.prefix.float()), 0.25),
        "visibility bool": lambda: attend(q, keys, values, queries._replace(visible=queries.visible.bool()), 0.25),
        "visibility for fewer tokens": lambda: attend(q, keys, values,
                                                      queries._replace(visible=queries.visible[:2]), 0.25),
        "visibility of no slots": lambda: attend(q, keys, values, queries._replace(
            visible=torch.zeros(3, 0, dtype=torch.uint8)), 0.25),
        "rows for fewer tokens": lambda: attend(q, keys, values, queries._replace(rows=queries.rows[:2]), 0.25),
        "rows not contiguous": lambda: attend(q, keys, values, queries._replace(
            rows=torch.ones(6, dtype=torch.long)[::2]), 0.25),
    }


def layer_ops_cases() -> Cases:
    g = torch.Generator().manual_seed(2)
    h, delta, w = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g), torch.rand(64, generator=g)
    gate, up = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    q, k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 1, 16, generator=g), torch.randn(3, 1, 16, generator=g)
    cos, sin = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    keys, values = torch.zeros(2, 1, 8, 16), torch.zeros(2, 1, 8, 16)
    rows, slots = torch.tensor([1, 1, 0]), torch.tensor([3, 4, 0])

    def rope(**change):
        args = dict(q=q.clone(), k=k, v=v, cos=cos, sin=sin, keys=keys, values=values, rows=rows, slots=slots)
        args.update(change)
        return layer_ops.rope_store(**args)

    norm, silu = layer_ops.add_rms_norm, layer_ops.silu_mul
    return {
        "good": lambda: (norm(h.clone(), delta, w, 1e-5), silu(gate, up), rope()),
        "norm: no rows": lambda: norm(torch.randn(0, 64), None, w, 1e-5),
        "norm: float64": lambda: norm(h.double(), None, w, 1e-5),
        "norm: weight of another size": lambda: norm(h.clone(), None, torch.rand(32), 1e-5),
        "norm: weight float64": lambda: norm(h.clone(), None, w.double(), 1e-5),
        "norm: weight 2-D": lambda: norm(h.clone(), None, w[None], 1e-5),
        "norm: delta of another shape": lambda: norm(h.clone(), delta[:2], w, 1e-5),
        "norm: delta int": lambda: norm(h.clone(), delta.int(), w, 1e-5),
        "norm: hidden size not a multiple of 16": lambda: norm(torch.randn(3, 40), None, torch.rand(40), 1e-5),
        "norm: strided last dimension": lambda: norm(torch.randn(3, 128)[:, ::2], None, w, 1e-5),
        "norm: overlapping rows": lambda: norm(torch.randn(64).expand(3, 64), None, w, 1e-5),
        "silu: shapes differ": lambda: silu(gate, up[:, :32]),
        "silu: no rows": lambda: silu(gate[:0], up[:0]),
        "silu: no columns": lambda: silu(gate[:, :0], up[:, :0]),
        "silu: float64": lambda: silu(gate.double(), up.double()),
        "silu: int": lambda: silu(gate.int(), up.int()),
        "rope: cache row past the cache": lambda: rope(rows=torch.tensor([1, 2, 0])),
        "rope: negative cache row": lambda: rope(rows=torch.tensor([1, -1, 0])),
        "rope: slot past the row": lambda: rope(slots=torch.tensor([3, 8, 0])),
        "rope: negative slot": lambda: rope(slots=torch.tensor([3, -1, 0])),
        "rope: rows float": lambda: rope(rows=rows.float()),
        "rope: one row too few": lambda: rope(rows=rows[:2]),
        "rope: odd head size": lambda: rope(q=torch.randn(3, 2, 15), k=torch.randn(3, 1, 15),
                                            v=torch.randn(3, 1, 15), cos=torch.randn(3, 15), sin=torch.randn(3, 15),
                                            keys=torch.zeros(2, 1, 8, 15), values=torch.zeros(2, 1, 8, 15)),
        "rope: cos of another size": lambda: rope(cos=cos[:, :8]),
        "rope: cos float64": lambda: rope(cos=cos.double()),
        "rope: cache not contiguous": lambda: rope(keys=torch.zeros(2, 1, 8, 32)[..., ::2]),
        "rope: cache float64": lambda: rope(keys=keys.double(), values=values.double()),
        "rope: caches of two shapes": lambda: rope(values=torch.zeros(3, 1, 8, 16)),
        "rope: cache of other heads": lambda: rope(keys=torch.zeros(2, 2, 8, 16), values=torch.zeros(2, 2, 8, 16)),
        "rope: q 2-D": lambda: rope(q=q.reshape(3, 32)),
        "rope: k of other tokens": lambda: rope(k=k[:2]),
        "rope: no tokens": lambda: rope(q=q[:0], k=k[:0], v=v[:0], cos=cos[:0], sin=sin[:0], rows=rows[:0],
                                        slots=slots[:0]),
        "rope: q heads not contiguous": lambda: rope(q=torch.randn(3, 16, 2).transpose(1, 2)),
    }


def _driver_model():
    """A one-layer model for the C loop, as its self-check builds one: (model, h, cos, sin, rows, slots,
    queries) of a valid 3-token step."""
    g = torch.Generator().manual_seed(3)
    t, D, H, G, d, I, L = 3, 32, 4, 2, 16, 48, 24
    Q, QKV = H * d, (H + 2 * G) * d
    panels = [panel_gemm.pack(torch.randn(n, k, generator=g) * 0.2) for n, k in ((QKV, D), (D, Q), (2 * I, D), (D, I))]
    norm_in, norm_post, final = (torch.rand(D, generator=g) + 0.5 for _ in range(3))
    keys, values = torch.randn(2, G, L, d, generator=g), torch.randn(2, G, L, d, generator=g)
    tensors = panels + [norm_in, norm_post, keys, values]
    pointers = (ctypes.c_void_p * 8)(*[x.data_ptr() for x in tensors])
    model = layer_driver.DriverModel(tensors, pointers, final, D, H, G, d, I, L, 1e-5, d ** -0.5)
    local = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    step = (torch.randn(1, t, D, generator=g), torch.rand(t, d, generator=g), torch.rand(t, d, generator=g),
            torch.tensor([1, 1, 1]), torch.tensor([5, 6, 7]), tree_attention.step_queries([1], [5], [3], local))
    return model, step


def layer_driver_cases() -> Cases:
    model, (h, cos, sin, rows, slots, queries) = _driver_model()
    local = torch.tril(torch.ones(1, 3, 3, dtype=torch.bool))

    def run(**change):
        args = dict(h=h.clone(), cos=cos, sin=sin, rows=rows, slots=slots, queries=queries)
        args.update(change)
        return layer_driver.run(model, **args)

    return {
        "good": lambda: run(),
        "no tokens": lambda: run(h=h[:, :0].clone(), cos=cos[:0], sin=sin[:0], rows=rows[:0], slots=slots[:0]),
        "h float64": lambda: run(h=h.double()),
        "h not contiguous": lambda: run(h=torch.randn(1, 32, 3).transpose(1, 2)),
        "h of another hidden size": lambda: run(h=torch.randn(1, 3, 48)),
        "h 2-D": lambda: run(h=h[0].clone()),
        "h of two sequences": lambda: run(h=h.expand(2, 3, 32).clone()),
        "cos of another size": lambda: run(cos=cos[:2]),
        "sin float64": lambda: run(sin=sin.double()),
        "cache row past the cache": lambda: run(rows=torch.tensor([1, 1, 2])),
        "slot past the row": lambda: run(slots=torch.tensor([5, 6, 24])),
        "negative slot": lambda: run(slots=torch.tensor([5, -6, 7])),
        "rows float": lambda: run(rows=rows.float()),
        "one slot too few": lambda: run(slots=slots[:2]),
        "queries' prefix past the row": lambda: run(queries=tree_attention.step_queries([1], [22], [3], local)),
        "queries' row past the cache": lambda: run(queries=tree_attention.step_queries([3], [5], [3], local)),
        "queries for fewer tokens": lambda: run(queries=tree_attention.step_queries([1], [5], [2], local[:, :2, :2])),
    }


def top_k_cases() -> Cases:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 64, generator=g)
    lib = top_k.KERNEL.get()
    return {
        "good": lambda: top_k.top_k_rows(logits, 4),
        "k zero": lambda: top_k.top_k_rows(logits, 0),
        "k past the vocabulary": lambda: top_k.top_k_rows(logits, 65),
        "3-D logits": lambda: top_k.top_k_rows(logits[None], 4),
        "1-D logits": lambda: top_k.top_k_rows(logits[0], 4),
        "k a float": lambda: top_k.top_k_rows(logits, 2.5),
        "kernel: no rows": lambda: top_k._run(lib, logits[:0], 4),
        "kernel: vocabulary not a multiple of 16": lambda: top_k._run(lib, torch.randn(2, 60), 4),
        "kernel: k past 64": lambda: top_k._run(lib, torch.randn(2, 256), 65),
        "kernel: k zero": lambda: top_k._run(lib, logits, 0),
        "kernel: float64": lambda: top_k._run(lib, logits.double(), 4),
        "kernel: strided rows": lambda: top_k._run(lib, torch.randn(64, 2).t(), 4),
        "kernel: overlapping rows": lambda: top_k._run(lib, torch.randn(64).expand(2, 64), 4),
    }


def roofline_cases() -> Cases:
    peak = roofline.measure_peak_gflops
    return {
        "good": lambda: peak(threads=1, seconds=0.001, repeats=1),
        "no threads": lambda: peak(threads=0, seconds=0.001, repeats=1),
        "negative threads": lambda: peak(threads=-2, seconds=0.001, repeats=1),
        "no time": lambda: peak(threads=1, seconds=0.0, repeats=1),
        "no repeats": lambda: peak(threads=1, seconds=0.001, repeats=0),
    }


GROUPS: dict[str, tuple[native.Kernel, Callable[[], Cases]]] = {
    "panel_gemm": (panel_gemm.KERNEL, panel_gemm_cases),
    "tree_attention": (tree_attention.KERNEL, tree_attention_cases),
    "layer_ops": (layer_ops.KERNEL, layer_ops_cases),
    "layer_driver": (layer_driver.KERNEL, layer_driver_cases),
    "top_k": (top_k.KERNEL, top_k_cases),
    "roofline": (roofline.KERNEL, roofline_cases),
}


def main(group: str) -> None:
    torch.set_num_threads(1)
    kernel, cases = GROUPS[group]
    if kernel.get() is None:  # raises instead under TR_SERVE_REQUIRE_KERNELS=1
        print(json.dumps({"unavailable": kernel.why_not or "switched off"}))
        return
    results: dict[str, str | None] = {}
    for name, call in cases().items():
        print(f"case: {name}", file=sys.stderr, flush=True)  # the last one names a crash
        try:
            call()
            results[name] = None
        except Exception as e:  # noqa: BLE001 - the class is the result
            results[name] = type(e).__name__
    print(json.dumps({"cases": results}))


if __name__ == "__main__":
    main(sys.argv[1])
