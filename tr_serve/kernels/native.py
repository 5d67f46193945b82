"""Building the runner's small C kernels on this machine, into one library, and loading it.

Why: each kernel is a few hundred lines of portable C (GCC vector extensions) compiled with
``-march=native`` by the C compiler found at start-up, so it uses AVX-512 where the CPU has it and
AVX2 or NEON elsewhere. The library links ``libgomp.so.1``: the copy torch has already loaded, so the
kernels run on torch's own OpenMP team and never compete with its threads.

The C lives in C files, ``tr_serve/kernels/csrc`` (package data): ``vec.h``, the vector types and helpers
they share; per kernel ``x.c`` and ``x.h``, the header declaring its functions, each prototype
written once. One compiler run builds every ``.c`` file into one library (:func:`build`), loaded
once per process (:class:`Library`); the ctypes bindings are read from the headers' prototypes
(:mod:`tr_serve.kernels.c_headers`). Each kernel (:class:`Kernel`) keeps its own switch, self-check
and fall-back to torch.

Loading a library runs its code in this process, so where they come from is guarded:

- They are built into and loaded from :func:`kernel_dir`, a directory of their own
  (``TR_SERVE_KERNEL_CACHE``, default ``~/.cache/tr_serve/compiled``), never ``TR_SERVE_CACHE``,
  which may be a volume shared by many hosts (weights, plans). The directory must be owned by this
  user and not writable by group or others (it is created, or tightened, to 0700), as must every
  directory above it unless sticky (``/tmp``); a library in it must be a regular file of this
  user's that no one else can write. Anything else is refused, not repaired.
- The library is cached per sources (all of them), flags, compiler and CPU (:func:`cpu_identity`:
  the model and feature list on x86 and aarch64), so one built for another CPU is never loaded here.
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
from typing import Callable, Mapping

import torch

from tr_serve.kernels import c_headers

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


CSRC = Path(__file__).resolve().parent / "csrc"  # the kernels' C sources (package data)
LIBRARY_NAME = "tr_kernels"
BUILD_TIMEOUT_S = 300  # one compiler run builds every kernel
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def read_sources(folder: Path) -> dict[str, str]:
    """The C sources (``*.c``, ``*.h``) in ``folder``, by file name; none where the folder is missing
    (an install without its package data: every kernel is then unavailable, not an import error)."""
    try:
        return {p.name: p.read_text() for p in sorted(folder.iterdir()) if p.suffix in (".c", ".h") and p.is_file()}
    except OSError:
        return {}


def _check_names(sources: Mapping[str, str]) -> None:
    for name in sources:
        if os.path.basename(name) != name or name.startswith(".") or not name.endswith((".c", ".h")):
            raise ValueError(f"a C source's name must be a plain file name ending .c or .h, not {name!r}")


def build(cc: str, name: str, sources: Mapping[str, str], folder: Path) -> Path:
    """The shared library of every ``.c`` file of ``sources`` (file name -> text), in ``folder``:
    compiled unless cached, after checking that ``folder`` is private (:func:`private_dir`) and the
    library this user's (:func:`check_library`). Each ``.c`` file is its own translation unit, so a
    file's ``#pragma`` stays its own. The sources are written into a private folder of their own and
    compiled from there: what is compiled is what the key hashed, whatever happens to the package's
    files meanwhile. Raises :class:`UnsafeKernelDir`, or CalledProcessError with the compiler's
    diagnostics."""
    _check_names(sources)
    units = sorted(n for n in sources if n.endswith(".c"))
    if not units:
        raise ValueError(f"{name}: no .c file to compile")
    flags = list(FLAGS)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    text = hashlib.sha256("".join(f"{n}\0{sources[n]}\0" for n in sorted(sources)).encode()).hexdigest()
    key = hashlib.sha256(f"{text}|{flags}|{version}|{cpu_identity()}".encode()).hexdigest()[:20]
    folder = private_dir(folder)
    lib = folder / f"{name}-{key}.so"
    if os.path.lexists(lib):
        check_library(lib)
        return lib
    src = folder / f"{name}-{key}.{os.getpid()}.src"
    tmp = folder / f"{name}-{key}.{os.getpid()}.so"
    shutil.rmtree(src, ignore_errors=True)  # left by an earlier process of this id that died mid-build
    try:
        src.mkdir(mode=PRIVATE_DIR_MODE)
        for n, body in sources.items():
            (src / n).write_text(body)
        subprocess.run([cc, *flags, *[str(src / n) for n in units], "-o", str(tmp)], check=True, capture_output=True,
                       text=True, timeout=BUILD_TIMEOUT_S)
        os.chmod(tmp, 0o700)  # whatever the umask (002 makes group-writable files)
        tmp.replace(lib)  # atomic: concurrent builders never load a half-written library
    finally:
        shutil.rmtree(src, ignore_errors=True)
        tmp.unlink(missing_ok=True)
    check_library(lib)
    return lib


class Library:
    """The one shared library of a set of C sources (:data:`KERNELS`: the package's ``csrc``), built
    and loaded at most once per process, compiler and kernel directory (thread-safe), with every
    function its interface headers declare bound for ctypes (:mod:`tr_serve.kernels.c_headers`)."""

    def __init__(self, name: str, sources: Path | Mapping[str, str]):
        self.name = name
        self.where = str(sources) if isinstance(sources, Path) else f"the {name} sources"
        self.sources = read_sources(sources) if isinstance(sources, Path) else dict(sources)
        self._opened: dict[tuple[str, str], tuple[ctypes.CDLL | None, str]] = {}
        self._lock = threading.Lock()

    def source_of(self, stem: str) -> str:
        """The text of ``stem.c`` and of each header it includes from these sources (directly or not),
        once each: what that kernel's code depends on (:attr:`Kernel.digest`). Empty without ``stem.c``."""
        order: list[str] = []
        todo = [f"{stem}.c"]
        while todo:
            name = todo.pop(0)
            if name in order or name not in self.sources:
                continue
            order.append(name)
            todo += INCLUDE.findall(self.sources[name])
        return "".join(f"/* {name} */\n{self.sources[name]}" for name in order)

    def load(self, cc: str | None) -> tuple[ctypes.CDLL | None, str]:
        """(the library, "") or (None, why not). Never raises."""
        if cc is None:
            return None, "no C compiler ($CC, cc or gcc)"
        if not torch_gomp_loaded():
            return None, "torch does not use libgomp"
        key = (cc, str(kernel_dir()))
        with self._lock:
            if key not in self._opened:
                self._opened[key] = self._open(cc, key[1])
            return self._opened[key]

    def _open(self, cc: str, folder: str) -> tuple[ctypes.CDLL | None, str]:
        if not any(n.endswith(".c") for n in self.sources):
            why = f"no C sources in {self.where}"
        else:
            try:
                bindings = c_headers.prototypes(self.sources)
                lib = ctypes.CDLL(str(build(cc, self.name, self.sources, Path(folder))))
                for proto in bindings.values():
                    fn = getattr(lib, proto.name)  # AttributeError: declared, but no file defines it
                    fn.argtypes, fn.restype = list(proto.argtypes), proto.restype
                return lib, ""
            except subprocess.CalledProcessError as e:
                why = f"the build failed: {(e.stderr or '').strip()[-COMPILER_OUTPUT_CHARS:]}"
            except (OSError, subprocess.SubprocessError, AttributeError, ValueError) as e:  # HeaderError too
                why = f"{type(e).__name__}: {e}"
        logger.warning("the %s library is unavailable: %s", self.name, why)
        return None, why


def _self_checked(title: str, lib: ctypes.CDLL,
                  self_check: Callable[[ctypes.CDLL], bool]) -> tuple[ctypes.CDLL | None, str]:
    """(``lib``, "") where the kernel passes ``self_check``, else (None, why not). Never raises."""
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
    """One kernel of a :class:`Library` (``stem.c``, declared in ``stem.h``), checked at most once per
    process (thread-safe): :attr:`lib` is the library once this kernel passed its ``self_check``, or
    None where it is not available here (``env`` set to ``0`` switches it off; with
    ``TR_SERVE_REQUIRE_KERNELS=1`` any other reason raises :class:`KernelUnavailable`, every time).
    Each kernel keeps its own switch and self-check: one failing leaves the others in use."""

    def __init__(self, title: str, stem: str, env: str, self_check: Callable[[ctypes.CDLL], bool],
                 library: Library | None = None, find_compiler: Callable[[], str | None] | None = None):
        self.title, self.stem, self.env, self.self_check = title, stem, env, self_check
        self.library = library if library is not None else KERNELS
        if self.library.sources and f"{stem}.c" not in self.library.sources:
            raise ValueError(f"{title}: no {stem}.c in {self.library.where}")
        self.source = self.library.source_of(stem)  # what :attr:`digest` hashes
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
                self.lib, self.why_not = self.library.load(cc)
                if self.lib is not None:
                    self.lib, self.why_not = _self_checked(self.title, self.lib, self.self_check)
                else:
                    logger.info("%s unavailable: %s", self.title, self.why_not.splitlines()[0])
            if self.lib is None and self.why_not and required():
                raise KernelUnavailable(f"{self.title} kernel unavailable ({REQUIRE_ENV}=1): {self.why_not}")
            return self.lib

    def get(self) -> ctypes.CDLL | None:
        if self.tried and (self.lib is not None or not self.why_not or not required()):
            return self.lib
        return self.load()  # raises why it is not available

    @property
    def digest(self) -> str:
        """A short hash of the kernel's source (:meth:`Library.source_of`): part of the keys of what
        was measured with this kernel (the kernel plan, the latency table), so a changed kernel is
        measured again."""
        return hashlib.sha256(self.source.encode()).hexdigest()[:12]


KERNELS = Library(LIBRARY_NAME, CSRC)  # every kernel of the package, in one library
