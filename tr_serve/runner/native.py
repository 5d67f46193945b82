"""Building the runner's small C kernels on this machine (panel GEMM, tree attention).

Why: each kernel is a few hundred lines of portable C (GCC vector extensions) compiled with
``-march=native`` by the C compiler found at start-up, so it uses AVX-512 where the CPU has it and
AVX2 or NEON elsewhere. Libraries link ``libgomp.so.1``: the copy torch has already loaded, so the
kernels run on torch's own OpenMP team and never compete with its threads.

Loading a library runs its code in this process, so where they come from is guarded:

- They are built into and loaded from :func:`kernel_dir`, a directory of their own
  (``TR_SERVE_KERNEL_CACHE``, default ``~/.cache/tr_serve/compiled``), never ``TR_SERVE_CACHE``,
  which may be a volume shared by many hosts (weights, plans). The directory must be owned by this
  user and not writable by group or others (it is created, or tightened, to 0700), as must every
  directory above it unless sticky (``/tmp``); a library in it must be a regular file of this
  user's that no one else can write. Anything else is refused, not repaired.
- Libraries are cached per source, flags, compiler and CPU (:func:`cpu_identity`: the model and
  feature list on x86 and aarch64), so one built for another CPU is never loaded here.
- Warnings are errors (``-Wall -Werror``).
- ``TR_SERVE_REQUIRE_KERNELS=1`` (set by CI) turns a kernel that cannot be built, loaded or that
  fails its self-check into a :class:`KernelUnavailable` error instead of the silent fall-back to
  torch, so its tests cannot skip.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import threading
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-Wall", "-Werror")
REQUIRE_ENV = "TR_SERVE_REQUIRE_KERNELS"  # 1: a kernel that is not available here is an error
KERNEL_CACHE_ENV = "TR_SERVE_KERNEL_CACHE"  # where compiled kernels are built and loaded from
PRIVATE_DIR_MODE = 0o700
# /proc/cpuinfo fields that say which instructions -march=native may use: x86's vendor, family, model
# and flags; aarch64's implementer, part, variant, revision and Features (aarch64 has no "flags", so a
# key from "flags" alone let a library built on one Arm CPU load on another); riscv's isa; POWER's cpu
CPU_FIELDS = frozenset({"vendor_id", "cpu family", "model", "model name", "stepping", "flags",
                        "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision", "Features",
                        "isa", "uarch", "cpu"})
COMPILER_OUTPUT_CHARS = 4000  # of a failed build's diagnostics, kept in the error


class KernelUnavailable(RuntimeError):
    """A compiled kernel is not available here while ``TR_SERVE_REQUIRE_KERNELS=1`` requires it."""


class UnsafeKernelDir(OSError):
    """The kernel directory or a library in it could be written by someone else: not loaded."""


def required() -> bool:
    """Whether ``TR_SERVE_REQUIRE_KERNELS`` makes an unavailable kernel an error."""
    return os.environ.get(REQUIRE_ENV, "0").strip() not in ("", "0")

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


# ---- argument checks shared by the kernels' wrappers ------------------------------------------
# A C kernel trusts its pointers and sizes: a wrong shape, dtype or index there is a crash or silent
# memory corruption, so every wrapper checks them first and raises ValueError / TypeError / IndexError.

def check_floats(name: str, x: torch.Tensor, dim: int | None = None) -> None:
    """``x`` is an fp32 CPU tensor (of ``dim`` dimensions when given)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: a tensor, not {type(x).__name__}")
    if x.dtype is not torch.float32 or not x.is_cpu:
        raise TypeError(f"{name}: an fp32 CPU tensor, not {x.dtype} on {x.device}")
    if dim is not None and x.dim() != dim:
        raise ValueError(f"{name}: {dim} dimensions, not {tuple(x.shape)}")


def check_indices(name: str, index: torch.Tensor, count: int, dtype: torch.dtype = torch.int64) -> None:
    """``index`` is a contiguous 1-D CPU tensor of ``dtype`` with ``count`` entries."""
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"{name}: a tensor, not {type(index).__name__}")
    if index.dtype is not dtype or not index.is_cpu or index.dim() != 1 or not index.is_contiguous():
        raise TypeError(f"{name}: a contiguous 1-D {dtype} CPU tensor, not {tuple(index.shape)} {index.dtype} "
                        f"on {index.device}")
    if index.numel() != count:
        raise ValueError(f"{name}: {count} entries, not {index.numel()}")


INTEGER_DTYPES = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})


def as_long_index(index: torch.Tensor) -> torch.Tensor:
    """An integer index tensor as contiguous int64, as the kernels read indices (anything else as it is,
    for :func:`check_indices` to refuse: a float index is a bug, not something to round)."""
    if not isinstance(index, torch.Tensor) or index.dtype not in INTEGER_DTYPES:
        return index
    if index.dtype is not torch.int64:
        index = index.to(torch.long)
    return index if index.is_contiguous() else index.contiguous()


def check_bounds(name: str, index: torch.Tensor, low: int, high: int) -> None:
    """Every entry of ``index`` (non-empty, 1-D) is in [low, high). (Kernels called once per layer
    check their indices in C instead: a read of the tensor here costs microseconds each time.)"""
    values = index.tolist()
    lo, hi = min(values), max(values)
    if lo < low or hi >= high:
        raise IndexError(f"{name}: entries must lie in [{low}, {high}), found [{lo}, {hi}]")


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


def kernel_dir() -> Path:
    """Where compiled kernels are built and loaded from: ``TR_SERVE_KERNEL_CACHE``, else
    ``compiled`` in the user's tr_serve cache (``$XDG_CACHE_HOME`` or ``~/.cache``). Deliberately
    not ``TR_SERVE_CACHE``: that may be a volume others can write (the k8s manifests share one
    between pods for the weights)."""
    explicit = os.environ.get(KERNEL_CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "tr_serve" / "compiled"


def _writable_by_others(mode: int) -> bool:
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH))


def _check_ancestors(path: Path) -> None:
    """Every directory above ``path`` (as written and as resolved) is owned by this user or root and
    not writable by others unless sticky: no one else can rename or replace the way to it."""
    uid = os.geteuid()
    above = {*Path(os.path.abspath(path)).parents, *Path(os.path.realpath(path)).parents}
    for parent in sorted(above, key=lambda p: len(p.parts)):
        st = os.stat(parent)
        if st.st_uid not in (uid, 0):
            raise UnsafeKernelDir(f"{parent}, above the kernel directory, belongs to uid {st.st_uid}")
        if _writable_by_others(st.st_mode) and not st.st_mode & stat.S_ISVTX:
            raise UnsafeKernelDir(f"{parent}, above the kernel directory, is writable by others "
                                  f"(mode {stat.S_IMODE(st.st_mode):o}, not sticky)")


def private_dir(path: Path) -> Path:
    """``path`` made ready to hold compiled kernels: created 0700 if absent (with any missing folder
    above it); an existing one must be a directory of this user's that group and others cannot write
    (then tightened to 0700), under directories no one else can change (:func:`_check_ancestors`).
    Raises :class:`UnsafeKernelDir`."""
    path = Path(os.path.abspath(path))
    for folder in [*reversed(path.parents), path]:  # what is missing is created 0700, whatever the umask
        try:
            folder.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(folder, PRIVATE_DIR_MODE)
    _check_ancestors(path)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        st = os.stat(path)  # a link to a directory: the target is checked (and its parents, above)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeKernelDir(f"the kernel directory {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeKernelDir(f"the kernel directory {path} belongs to uid {st.st_uid}, not {os.geteuid()}")
    if _writable_by_others(st.st_mode):
        raise UnsafeKernelDir(f"the kernel directory {path} is writable by group or others "
                              f"(mode {stat.S_IMODE(st.st_mode):o}): refusing what it holds")
    if stat.S_IMODE(st.st_mode) != PRIVATE_DIR_MODE:
        os.chmod(path, PRIVATE_DIR_MODE)
    return path


def check_library(lib: Path) -> None:
    """A library about to be loaded is a regular file of this user's that no one else can write."""
    st = os.lstat(lib)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeKernelDir(f"{lib} is not a regular file")
    if st.st_uid != os.geteuid():
        raise UnsafeKernelDir(f"{lib} belongs to uid {st.st_uid}, not {os.geteuid()}: not loaded")
    if _writable_by_others(st.st_mode):
        raise UnsafeKernelDir(f"{lib} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): not loaded")


def cpu_identity(cpuinfo: str | None = None, machine: str | None = None) -> str:
    """What ``-march=native`` depends on, for the cache key: the architecture and the distinct values
    of :data:`CPU_FIELDS` over all of ``/proc/cpuinfo`` (``cpuinfo``; every core's, so a big.LITTLE
    CPU's parts all count), e.g. x86's model and flags, aarch64's CPU part and Features. Where there
    is no ``/proc/cpuinfo``, what :mod:`platform` says."""
    machine = machine or platform.machine()
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return f"{machine}|{platform.processor()}"
    fields = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in CPU_FIELDS:
            fields.add(f"{key.strip()}: {' '.join(value.split())}")
    return "\n".join([machine, *sorted(fields)])


def build(cc: str, name: str, source: str, folder: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library of ``source`` in ``folder`` (compiled unless cached), after checking that
    ``folder`` is private (:func:`private_dir`) and the library this user's (:func:`check_library`).
    Raises :class:`UnsafeKernelDir`, or CalledProcessError with the compiler's diagnostics."""
    flags = [*FLAGS, *extra_flags]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    key = hashlib.sha256(f"{source}|{flags}|{version}|{cpu_identity()}".encode()).hexdigest()[:20]
    folder = private_dir(folder)
    lib = folder / f"{name}-{key}.so"
    if os.path.lexists(lib):
        check_library(lib)
        return lib
    src = folder / f"{name}-{key}.{os.getpid()}.c"
    tmp = folder / f"{name}-{key}.{os.getpid()}.so"
    src.write_text(source)
    try:
        subprocess.run([cc, *flags, str(src), "-o", str(tmp)], check=True, capture_output=True, text=True,
                       timeout=120)
        os.chmod(tmp, 0o700)  # whatever the umask (002 makes group-writable files)
        tmp.replace(lib)  # atomic: concurrent builders never load a half-written library
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    check_library(lib)
    return lib


def load_kernel(title: str, name: str, source: str, cc: str | None, function: str, argtypes: list,
                self_check: Callable[[ctypes.CDLL], bool]) -> tuple[ctypes.CDLL | None, str]:
    """Build (or reuse) and load ``source``, declare ``function`` (returning int), and run the
    kernel's ``self_check``: (the library, "") or (None, why not), logged under ``title``.
    Never raises."""
    if cc is None or not torch_gomp_loaded():
        why = "no C compiler ($CC, cc or gcc)" if cc is None else "torch does not use libgomp"
        logger.info("%s unavailable (%s)", title, why)
        return None, why
    try:
        lib = ctypes.CDLL(str(build(cc, name, source, kernel_dir())))
        fn = getattr(lib, function)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    except subprocess.CalledProcessError as e:
        why = f"the build failed: {(e.stderr or '').strip()[-COMPILER_OUTPUT_CHARS:]}"
        logger.warning("%s unavailable: %s", title, why)
        return None, why
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        why = f"{type(e).__name__}: {e}"
        logger.warning("%s unavailable: %s", title, why)
        return None, why
    try:
        passed = self_check(lib)
    except Exception as e:  # noqa: BLE001 - a self-check that raises has failed
        passed, why = False, f"its self-check raised {type(e).__name__}: {e}"
    else:
        why = "it failed its self-check"
    if not passed:
        logger.warning("%s not used: %s", title, why)
        return None, why
    return lib, ""


class Kernel:
    """One compiled kernel, loaded at most once per process (thread-safe): :attr:`lib` is the
    library, or None where it is not available here (``env`` set to ``0`` switches it off; with
    ``TR_SERVE_REQUIRE_KERNELS=1`` any other reason raises :class:`KernelUnavailable`, every time)."""

    def __init__(self, title: str, name: str, source: str, env: str, function: str, argtypes: list,
                 self_check: Callable[[ctypes.CDLL], bool], find_compiler: Callable[[], str | None] | None = None):
        self.title, self.name, self.source, self.env = title, name, source, env
        self.function, self.argtypes, self.self_check = function, argtypes, self_check
        self.find_compiler = find_compiler
        self.lib: ctypes.CDLL | None = None
        self.tried = False
        self.why_not = ""  # why the last load gave no library ("" when switched off or loaded)
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        """The library (built once per machine into :func:`kernel_dir`), or None. Raises
        :class:`KernelUnavailable` instead of None under ``TR_SERVE_REQUIRE_KERNELS=1``, unless
        switched off by its own variable."""
        with self._lock:
            if not self.tried:
                self.tried = True
                self.why_not = ""
                if os.environ.get(self.env, "1") == "0":
                    return None
                cc = self.find_compiler() if self.find_compiler is not None else compiler()
                self.lib, self.why_not = load_kernel(self.title, self.name, self.source, cc, self.function,
                                                     self.argtypes, self.self_check)
            if self.lib is None and self.why_not and required():
                raise KernelUnavailable(f"{self.title} kernel unavailable ({REQUIRE_ENV}=1): {self.why_not}")
            return self.lib

    def get(self) -> ctypes.CDLL | None:
        if self.tried and (self.lib is not None or not self.why_not or not required()):
            return self.lib
        return self.load()  # raises why it is not available

    @property
    def digest(self) -> str:
        """A short hash of the source: part of the keys of what was measured with this kernel (the
        kernel plan, the latency table), so a changed kernel is measured again."""
        return hashlib.sha256(self.source.encode()).hexdigest()[:12]
