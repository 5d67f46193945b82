"""The kernels' C lives in C files (tr_serve/kernels/csrc): no Python string of the package holds C source,
each exported function's prototype is written once, in the header of its C file (which the C file
includes, so the compiler checks the definition against it), the ctypes bindings are read from those
prototypes (kernels/c_headers.py), one vector header declares the vector types, and the package ships
every source file."""

from __future__ import annotations

import ast
import ctypes
import fnmatch
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

import tr_serve
from tests.kernel_testutil import kernel_missing
from tr_serve.bench import roofline
from tr_serve.kernels import c_headers, layer_driver, layer_ops, native, panel_gemm, top_k, tree_attention

PACKAGE = Path(tr_serve.__file__).resolve().parent
ROOT = PACKAGE.parent
SOURCES = {p.name: p.read_text() for p in sorted(native.CSRC.iterdir())}
KERNELS = (panel_gemm.KERNEL, tree_attention.KERNEL, layer_ops.KERNEL, layer_driver.KERNEL, top_k.KERNEL,
           roofline.KERNEL)
# what only C source holds (not a mention of it in prose): a line that is a preprocessor directive or a
# typedef, a GCC attribute, a function definition
C_MARKERS = re.compile(r"^[ \t]*#[ \t]*(include|pragma|define|if|ifdef|ifndef)\b|^[ \t]*typedef\s+[\w\s*]+;"
                       r"|__attribute__\s*\(\(|\b(int|void|float|double|v16|int64_t)\s+\**\w+\s*\([^()]*\)\s*\{",
                       re.M)
# a top-level definition of an exported function (static ones are the files' own)
DEFINITION = re.compile(r"^(?!static\b)[A-Za-z_][\w \t*]*?\b(\w+)\s*\([^;{}]*\)\s*\{", re.M)


def _code(text: str) -> str:
    """C text without comments and preprocessor lines."""
    return c_headers.DIRECTIVE.sub("", c_headers.COMMENT.sub(" ", text))


def _strings(path: Path) -> list[str]:
    return [node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_no_python_file_of_the_package_holds_c_source():
    holding = {f"{path.relative_to(ROOT)}: {match.group(0)!r}"
               for path in PACKAGE.rglob("*.py") for text in _strings(path)
               for match in [C_MARKERS.search(text)] if match}
    assert not holding, sorted(holding)


def test_the_markers_find_c_in_a_python_string(tmp_path):
    """(The check above can fail: the old form of a kernel, C in a string, is caught.)"""
    old = tmp_path / "old_kernel.py"
    old.write_text('SOURCE = r"""\n#include <stdint.h>\nint tr_answer(void) { return 42; }\n"""\n')
    assert any(C_MARKERS.search(s) for s in _strings(old))


def test_each_exported_function_is_declared_once_in_its_files_header():
    headers = c_headers.interface_headers(SOURCES)
    assert sorted(n for n in SOURCES if n.endswith(".h")) == sorted([*headers, "vec.h"])
    declared = Counter(p.name for h in headers for p in c_headers.declared(h, SOURCES[h]))
    assert declared and all(count == 1 for count in declared.values()), declared
    defined = {}
    for name in (n for n in SOURCES if n.endswith(".c")):
        stem = name[:-2]
        assert f"{stem}.h" in SOURCES, f"{name} has no header"
        assert re.search(rf'^#include "{stem}\.h"', SOURCES[name], re.M), f"{name} does not include {stem}.h"
        own = {p.name for p in c_headers.declared(f"{stem}.h", SOURCES[f"{stem}.h"])}
        for function in DEFINITION.findall(_code(SOURCES[name])):
            assert function not in defined, f"{function} is defined in {defined[function]} and {name}"
            assert function in own, f"{name} defines {function}, which {stem}.h does not declare"
            assert function.startswith("tr_"), f"{name}: exported {function} is not named tr_*"
            defined[function] = name
    assert set(defined) == set(declared), "declared but defined nowhere, or the reverse"
    assert set(c_headers.prototypes(SOURCES)) == set(declared)
    # vec.h: helpers every file compiles for itself, nothing exported
    assert not DEFINITION.findall(_code(SOURCES["vec.h"]))


def test_the_vector_types_are_declared_in_vec_h_only():
    holding = sorted(n for n, text in SOURCES.items() if "vector_size" in _code(text))
    assert holding == ["vec.h"]
    for name in (n for n in SOURCES if n.endswith(".c")):
        if "v16" in _code(SOURCES[name]) or "vnat" in _code(SOURCES[name]):
            assert '#include "vec.h"' in SOURCES[name], name


def test_the_bindings_are_the_prototypes():
    bindings = c_headers.prototypes(SOURCES)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    tree = bindings["tr_tree_attention"]
    assert tree.restype is ctypes.c_int and tree.header == "tree_attention.h"
    assert tree.argtypes == (p,) * 4 + (i64,) * 4 + (p,) * 3 + (i64,) * 5 + (ctypes.c_float, ctypes.c_int)
    assert bindings["tr_panel_gemm_set_wide_narrow"].restype is None
    assert bindings["tr_fma_peak"].argtypes == (i64, ctypes.c_int, p)


def test_header_parsing_refuses_what_it_cannot_bind():
    proto = c_headers.declared("x.h", "/* a */\nint64_t tr_f(const float *restrict a, int64_t n,\n  uint8_t b);\n"
                                      "void tr_g(void);\n#define N 3\n")
    assert [(q.name, q.restype, q.argtypes) for q in proto] == [
        ("tr_f", ctypes.c_int64, (ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint8)), ("tr_g", None, ())]
    for bad in ("long tr_f(int a);", "int tr_f(size_t n);", "int tr_f(int (*fn)(int));", "int tr_f(int a, ...);",
                "int tr_f(void v);", "static inline int tr_f(int a) { return a; }"):
        with pytest.raises(c_headers.HeaderError):
            c_headers.declared("x.h", bad)
    with pytest.raises(c_headers.HeaderError, match="declared in a.h and again in b.h"):
        c_headers.prototypes({"a.c": "", "a.h": "int tr_f(int a);", "b.c": "", "b.h": "int tr_f(int a);"})
    assert c_headers.defines("#define N 3\n/* #define M 4 */\n#define S \"x\"\n") == {"N": 3}


def test_python_constants_are_the_headers():
    assert panel_gemm.PREFETCH_L2_MAX_ROWS == c_headers.defines(SOURCES["panel_gemm.h"])["PREFETCH_L2_MAX_ROWS"]
    assert top_k.MAX_K == c_headers.defines(SOURCES["top_k.h"])["TOP_K_MAX"]
    assert roofline.CHAINS == c_headers.defines(SOURCES["fma_peak.h"])["FMA_CHAINS"]


def test_a_kernels_digest_follows_its_own_files():
    """A kernel's digest (part of the keys of the kernel plan and the latency table) covers its C file
    and the headers it includes, not the other kernels' files."""
    gemm = panel_gemm.KERNEL.source
    assert "/* panel_gemm.c */" in gemm and "/* panel_gemm.h */" in gemm and "/* vec.h */" in gemm
    assert "tr_top_k" not in gemm and "tr_tree_attention" not in gemm
    driver = layer_driver.KERNEL.source
    assert all(f"/* {h} */" in driver for h in ("layer_driver.c", "layer_ops.h", "panel_gemm.h", "tree_attention.h"))
    assert len({k.digest for k in KERNELS}) == len(KERNELS)


def test_the_package_ships_every_c_source():
    """pyproject's package data names every file of csrc (a wheel without them has no kernels)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tr_serve"]
    for name in SOURCES:
        assert any(fnmatch.fnmatch(f"kernels/csrc/{name}", pattern) for pattern in data), name


@pytest.mark.skipif(any(kernel_missing(k) for k in KERNELS), reason="no C compiler or torch without libgomp here")
def test_one_library_serves_every_kernel():
    """Every kernel of the package is one loaded library, exporting exactly the headers' functions."""
    libs = {id(k.get()) for k in KERNELS}
    assert len(libs) == 1
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm here to list the library's symbols")
    out = subprocess.run([nm, "-D", "--defined-only", panel_gemm.KERNEL.get()._name], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.split()[1:2] == ["T"]}
    assert exported == set(c_headers.prototypes(SOURCES))
