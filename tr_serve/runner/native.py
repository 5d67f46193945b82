"""Building the runner's small C kernels on this machine (panel GEMM, tree attention).

Why: each kernel is a few hundred lines of portable C (GCC vector extensions) compiled with
``-march=native`` by the C compiler found at start-up, so it uses AVX-512 where the CPU has it and
AVX2 or NEON elsewhere. Libraries are cached per source, flags, compiler and CPU flags in the
tr_serve cache, and link ``libgomp.so.1``: the copy torch has already loaded, so the kernels run on
torch's own OpenMP team and never compete with its threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

# What the vector kernels share: 16-float vectors (GCC vector extensions), unaligned loads and
# stores, a broadcast, a sum of the lanes in a fixed order (so a kernel's sums do not depend on
# how the compiler schedules them), and a test of whether any lane of a compare is set.
VECTOR_PRELUDE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 splat(float x) { return (v16){0} + x; }

/* sum of the 16 lanes, halves folded in a fixed order */
static inline float hsum(v16 a) {
    a += __builtin_shuffle(a, (i16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    a += __builtin_shuffle(a, (i16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    a += __builtin_shuffle(a, (i16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    a += __builtin_shuffle(a, (i16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return a[0];
}

/* whether any lane of m is set, halves folded as in hsum (a loop over the lanes compiles to a chain
   of scalar extracts) */
static inline int any_lane(i16 m) {
    m |= __builtin_shuffle(m, (i16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    m |= __builtin_shuffle(m, (i16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    m |= __builtin_shuffle(m, (i16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    m |= __builtin_shuffle(m, (i16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return m[0] != 0;
}

/* exp(x) for x in [-87, 88] (Cephes expf, about 1 ulp); the callers clamp and mask */
static inline v16 exp_in_range(v16 x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    v16 t = x * 1.44269504088896341f + magic;
    v16 n = t - magic;
    v16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    i16 e = ((i16)t - (i16)splat(magic) + 127) << 23;
    return p * (v16)e;
}
"""


def compiler() -> str | None:
    """``$CC``, ``cc`` or ``gcc``, whichever is found first."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def torch_gomp_loaded() -> bool:
    """torch's OpenMP runtime is libgomp and already mapped, so ours resolves to the same copy."""
    try:
        maps = open("/proc/self/maps").read()
    except OSError:
        return False
    return re.search(r"/libgomp[\w.-]*\.so", maps) is not None


def build(cc: str, name: str, source: str, folder: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library of ``source`` in ``folder`` (compiled unless cached)."""
    flags = [*FLAGS, *extra_flags]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    cpu = platform.processor() or platform.machine()
    try:  # -march=native follows the CPU's flags: part of the key
        cpu += "".join(line for line in open("/proc/cpuinfo") if line.startswith("flags"))[:4000]
    except OSError:
        pass
    key = hashlib.sha256(f"{source}|{flags}|{version}|{cpu}".encode()).hexdigest()[:20]
    lib = folder / f"{name}-{key}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / f"{name}-{key}.{os.getpid()}.c"
    tmp = folder / f"{name}-{key}.{os.getpid()}.so"
    src.write_text(source)
    try:
        subprocess.run([cc, *flags, str(src), "-o", str(tmp)], check=True, capture_output=True, text=True,
                       timeout=120)
        tmp.replace(lib)  # atomic: concurrent builders never load a half-written library
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return lib


def load_kernel(title: str, name: str, source: str, cc: str | None, function: str, argtypes: list,
                self_check: Callable[[ctypes.CDLL], bool]) -> ctypes.CDLL | None:
    """Build (or reuse) and load ``source``, declare ``function`` (returning int), and run the
    kernel's ``self_check``; None, logged under ``title``, when any of it is not possible here.
    Never raises."""
    if cc is None or not torch_gomp_loaded():
        logger.info("%s unavailable (%s)", title, "no C compiler" if cc is None else "torch does not use libgomp")
        return None
    try:
        from tr_serve.model_loader import cache_root

        lib = ctypes.CDLL(str(build(cc, name, source, cache_root() / "kernels")))
        fn = getattr(lib, function)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        if not self_check(lib):
            logger.warning("%s failed its self-check: not used", title)
            return None
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        logger.info("%s unavailable: %s", title, e)
        return None
    return lib


class Kernel:
    """One compiled kernel, loaded at most once per process (thread-safe): :attr:`lib` is the
    library, or None where it is not available here (``env`` set to ``0`` switches it off)."""

    def __init__(self, title: str, name: str, source: str, env: str, function: str, argtypes: list,
                 self_check: Callable[[ctypes.CDLL], bool], find_compiler: Callable[[], str | None] | None = None):
        self.title, self.name, self.source, self.env = title, name, source, env
        self.function, self.argtypes, self.self_check = function, argtypes, self_check
        self.find_compiler = find_compiler
        self.lib: ctypes.CDLL | None = None
        self.tried = False
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        """The library (built once per machine into the tr_serve cache), or None. Never raises."""
        with self._lock:
            if self.tried:
                return self.lib
            self.tried = True
            if os.environ.get(self.env, "1") == "0":
                return None
            cc = self.find_compiler() if self.find_compiler is not None else compiler()
            self.lib = load_kernel(self.title, self.name, self.source, cc, self.function,
                                   self.argtypes, self.self_check)
            return self.lib

    def get(self) -> ctypes.CDLL | None:
        return self.lib if self.tried else self.load()

    @property
    def digest(self) -> str:
        """A short hash of the source: part of the keys of what was measured with this kernel (the
        kernel plan, the latency table), so a changed kernel is measured again."""
        return hashlib.sha256(self.source.encode()).hexdigest()[:12]
