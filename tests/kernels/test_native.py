"""Where compiled kernels come from and what happens when one cannot be had (kernels/native.py):
a private directory (0700, this user's, under directories no one else can change) that refuses
anything others could have written; a cache key with the CPU's model and features on x86 and
aarch64; -Wall -Werror; TR_SERVE_REQUIRE_KERNELS=1 turning a failed build or self-check into an
error, so that CI with a broken kernel source fails instead of skipping the kernel tests."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tr_serve.kernels import native

ROOT = Path(__file__).resolve().parents[2]
TINY = '#include "tiny.h"\nint tr_answer(void) { return 42; }\n'
TINY_H = "int tr_answer(void);\n"
SUBPROCESS_TIMEOUT_S = 600

needs_compiler = pytest.mark.skipif(not native.required() and (native.compiler() is None
                                                                or not native.torch_gomp_loaded()),
                                    reason="no C compiler or torch without libgomp here")

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
stepping\t: 1
cpu MHz\t\t: 2600.000
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512bw

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
stepping\t: 1
cpu MHz\t\t: 3100.000
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512bw
"""
# aarch64's /proc/cpuinfo: no "flags", no "model name"; a big.LITTLE part pair
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1

processor\t: 1
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd05
CPU revision\t: 0
"""


def _tiny(source: str = TINY) -> dict[str, str]:
    return {"tiny.c": source, "tiny.h": TINY_H}


def _kernel(source: str = TINY, check=lambda lib: lib.tr_answer() == 42, name: str = "tiny") -> native.Kernel:
    """A kernel of a library of its own (a fresh one each call, as a new process would load it)."""
    return native.Kernel("test kernel", "tiny", "TR_SERVE_TEST_KERNEL", check, native.Library(name, _tiny(source)))


@pytest.fixture
def kernel_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "kernels"
    monkeypatch.setenv(native.KERNEL_CACHE_ENV, str(path))
    monkeypatch.delenv(native.REQUIRE_ENV, raising=False)
    return path


# ---- the cache key -----------------------------------------------------------------------------
def test_cpu_identity_names_the_model_and_features_on_x86_and_aarch64():
    x86 = native.cpu_identity(X86_CPUINFO, "x86_64")
    assert "model name: AMD EPYC 9B14" in x86 and "flags: fpu vme sse sse2 avx avx2 avx512f avx512bw" in x86
    assert "MHz" not in x86 and x86.count("flags") == 1  # per-core clocks do not split the key; cores dedup
    arm = native.cpu_identity(ARM_CPUINFO, "aarch64")
    assert "Features: fp asimd" in arm and "asimddp" in arm
    assert "CPU part: 0xd0c" in arm and "CPU part: 0xd05" in arm  # both parts of a big.LITTLE CPU
    assert "CPU implementer: 0x41" in arm and "BogoMIPS" not in arm
    # another Arm CPU: same architecture, one feature less (no dot product), another part
    other = ARM_CPUINFO.replace(" asimddp", "").replace("0xd0c", "0xd08")
    assert native.cpu_identity(other, "aarch64") != arm
    assert native.cpu_identity(X86_CPUINFO.replace(" avx512f avx512bw", ""), "x86_64") != x86
    assert native.cpu_identity(X86_CPUINFO.replace("9B14", "9654"), "x86_64") != x86


@needs_compiler
def test_a_library_built_for_another_cpu_is_not_loaded(kernel_dir, monkeypatch):
    """The key follows the CPU: a library built under one CPU's identity is not the one another finds."""
    cc = native.compiler()
    arm = native.cpu_identity(ARM_CPUINFO, "aarch64")
    without_dot_product = native.cpu_identity(ARM_CPUINFO.replace(" asimddp", ""), "aarch64")
    monkeypatch.setattr(native, "cpu_identity", lambda: arm)
    built = native.build(cc, "tiny", _tiny(), kernel_dir)
    assert native.build(cc, "tiny", _tiny(), kernel_dir) == built  # same CPU: reused
    monkeypatch.setattr(native, "cpu_identity", lambda: without_dot_product)
    other = native.build(cc, "tiny", _tiny(), kernel_dir)
    assert other != built and built.exists() and other.exists()


# ---- the private directory ---------------------------------------------------------------------
def test_kernels_are_not_in_tr_serve_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(native.KERNEL_CACHE_ENV, raising=False)
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path / "shared"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    assert native.kernel_dir() == tmp_path / "home-cache" / "tr_serve" / "compiled"
    monkeypatch.setenv(native.KERNEL_CACHE_ENV, str(tmp_path / "mine"))
    assert native.kernel_dir() == tmp_path / "mine"


def test_private_dir_is_created_0700_whatever_the_umask(tmp_path):
    old = os.umask(0o002)  # a umask that makes group-writable files and folders
    try:
        path = native.private_dir(tmp_path / "a" / "kernels")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700 and path.stat().st_uid == os.geteuid()


def test_an_existing_readable_dir_is_tightened_to_0700(tmp_path):
    path = tmp_path / "kernels"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    native.private_dir(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o722])
def test_a_dir_others_can_write_is_refused(tmp_path, mode):
    path = tmp_path / "kernels"
    path.mkdir()
    os.chmod(path, mode)
    with pytest.raises(native.UnsafeKernelDir, match="writable by group or others"):
        native.private_dir(path)
    assert stat.S_IMODE(path.stat().st_mode) == mode  # refused, not repaired


def test_a_dir_of_another_user_is_refused(tmp_path, monkeypatch):
    path = native.private_dir(tmp_path / "kernels")
    monkeypatch.setattr(os, "geteuid", lambda: path.stat().st_uid + 4242)  # as seen by another user
    with pytest.raises(native.UnsafeKernelDir, match="belongs to uid"):
        native.private_dir(path)


def test_a_dir_under_a_folder_others_can_write_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could rename the kernel folder away and put another in its place
    with pytest.raises(native.UnsafeKernelDir, match="above the kernel directory"):
        native.private_dir(shared / "me" / "kernels")
    os.chmod(shared, 0o1777)  # sticky, as /tmp: only the owner renames its entries
    assert native.private_dir(shared / "me2" / "kernels").is_dir()


@needs_compiler
def test_a_library_others_can_write_or_do_not_own_is_refused(kernel_dir, monkeypatch):
    kernel = _kernel()
    assert kernel.load() is not None
    [lib] = kernel_dir.glob("tiny-*.so")
    os.chmod(lib, 0o770)
    again = _kernel()
    assert again.load() is None and "writable by group or others" in again.why_not
    os.chmod(lib, 0o700)
    native.check_library(lib)
    monkeypatch.setattr(os, "geteuid", lambda: lib.stat().st_uid + 4242)  # as seen by another user
    with pytest.raises(native.UnsafeKernelDir, match="belongs to uid"):
        native.check_library(lib)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
@needs_compiler
def test_a_library_of_another_user_in_the_dir_is_refused(kernel_dir):
    kernel = _kernel()
    assert kernel.load() is not None
    [lib] = kernel_dir.glob("tiny-*.so")
    os.chown(lib, 65534, 65534)  # nobody
    again = _kernel()
    assert again.load() is None and "belongs to uid 65534" in again.why_not


# ---- one library of C files, bound from its headers ---------------------------------------------
@needs_compiler
def test_the_bindings_are_the_headers_prototypes(kernel_dir):
    """A 64-bit argument and result pass whole: ctypes' default (int) would cut them to 32 bits."""
    sources = {"wide.c": '#include "wide.h"\nint64_t tr_twice(int64_t x) { return 2 * x; }\n',
               "wide.h": "#include <stdint.h>\nint64_t tr_twice(int64_t x);\n"}
    kernel = native.Kernel("test kernel", "wide", "TR_SERVE_TEST_KERNEL", lambda lib: lib.tr_twice(3) == 6,
                           native.Library("wide", sources))
    assert kernel.load().tr_twice(1 << 40) == 1 << 41


@needs_compiler
def test_kernels_of_one_library_share_it_and_keep_their_own_self_checks(kernel_dir):
    """Two C files, one compiler run, one library: each kernel has its own functions, the other's
    failed self-check leaves it in use, and a pragma stays in its own file (its own translation unit)."""
    library = native.Library("pair", {
        "one.c": '#pragma GCC optimize("fp-contract=off")\n#include "one.h"\nint tr_one(void) { return 1; }\n',
        "one.h": "int tr_one(void);\n",
        "two.c": '#include "two.h"\nint tr_two(void) { return 2; }\n',
        "two.h": "int tr_two(void);\n"})
    one = native.Kernel("one", "one", "TR_SERVE_TEST_ONE", lambda lib: lib.tr_one() == 1, library)
    two = native.Kernel("two", "two", "TR_SERVE_TEST_TWO", lambda lib: lib.tr_two() == 3, library)  # wrong
    assert one.load() is not None and two.load() is None and "self-check" in two.why_not
    assert one.load().tr_two() == 2  # the same library holds both
    assert [p.suffix for p in kernel_dir.iterdir()] == [".so"]  # one library, its sources cleaned up
    assert "tr_one" in one.source and "tr_two" not in one.source and one.digest != two.digest


@needs_compiler
def test_a_declared_function_no_file_defines_makes_the_library_unavailable(kernel_dir):
    sources = _tiny()
    sources["tiny.h"] += "int tr_missing(int x);\n"
    kernel = native.Kernel("test kernel", "tiny", "TR_SERVE_TEST_KERNEL", lambda lib: True,
                           native.Library("tiny", sources))
    assert kernel.load() is None and "tr_missing" in kernel.why_not


def test_missing_sources_make_the_kernels_unavailable_not_an_import_error(kernel_dir, monkeypatch, tmp_path):
    """An install without its package data: no C files, every kernel falls back to torch (or, when
    required, says why)."""
    library = native.Library("gone", tmp_path / "no-such-folder")
    kernel = native.Kernel("test kernel", "tiny", "TR_SERVE_TEST_KERNEL", lambda lib: True, library)
    assert kernel.source == "" and kernel.load() is None
    with pytest.raises(ValueError, match="no typo.c"):  # where the sources are there, a wrong name is a bug
        native.Kernel("test kernel", "typo", "TR_SERVE_TEST_KERNEL", lambda lib: True, native.Library("t", _tiny()))
    if native.compiler() is not None and native.torch_gomp_loaded():
        assert "no C sources" in kernel.why_not
        monkeypatch.setenv(native.REQUIRE_ENV, "1")
        with pytest.raises(native.KernelUnavailable, match="no C sources"):
            kernel.get()


def test_a_source_name_must_be_a_plain_c_file_name(kernel_dir):
    for name in ("../evil.c", "sub/x.c", ".hidden.c", "x.py"):
        with pytest.raises(ValueError, match="plain file name"):
            native.build("cc", "bad", {name: "", "ok.c": ""}, kernel_dir)


# ---- build errors and TR_SERVE_REQUIRE_KERNELS ---------------------------------------------------
@needs_compiler
def test_warnings_are_errors(kernel_dir):
    assert "-Wall" in native.FLAGS and "-Werror" in native.FLAGS
    kernel = _kernel(TINY + "static int unused(void) { int x; return 0; }\n")
    assert kernel.load() is None and "the build failed" in kernel.why_not and "unused" in kernel.why_not


@needs_compiler
def test_required_a_broken_source_raises_with_the_compilers_words(kernel_dir, monkeypatch):
    kernel = _kernel(TINY + "int broken(void) { return undeclared_name; }\n")
    assert kernel.load() is None and kernel.get() is None  # not required: torch's path, logged
    monkeypatch.setenv(native.REQUIRE_ENV, "1")
    kernel = _kernel(TINY + "int broken(void) { return undeclared_name; }\n")
    with pytest.raises(native.KernelUnavailable, match="undeclared_name"):
        kernel.load()
    with pytest.raises(native.KernelUnavailable):  # every later use too, not a silent None
        kernel.get()


@needs_compiler
def test_required_a_failed_or_raising_self_check_raises(kernel_dir, monkeypatch):
    monkeypatch.setenv(native.REQUIRE_ENV, "1")
    with pytest.raises(native.KernelUnavailable, match="failed its self-check"):
        _kernel(check=lambda lib: lib.tr_answer() == 41).load()

    def boom(lib):
        raise ValueError("a wrong answer")

    with pytest.raises(native.KernelUnavailable, match="a wrong answer"):
        _kernel(check=boom).load()
    assert _kernel().load().tr_answer() == 42


def test_required_no_compiler_raises_but_switched_off_does_not(kernel_dir, monkeypatch):
    monkeypatch.setenv(native.REQUIRE_ENV, "1")
    kernel = _kernel()
    kernel.find_compiler = lambda: None
    with pytest.raises(native.KernelUnavailable, match="no C compiler"):
        kernel.get()
    monkeypatch.setenv("TR_SERVE_TEST_KERNEL", "0")  # switched off on purpose: no error
    assert _kernel().get() is None


@needs_compiler
def test_required_an_unsafe_dir_raises(tmp_path, monkeypatch):
    path = tmp_path / "kernels"
    path.mkdir()
    os.chmod(path, 0o777)
    monkeypatch.setenv(native.KERNEL_CACHE_ENV, str(path))
    monkeypatch.setenv(native.REQUIRE_ENV, "1")
    with pytest.raises(native.KernelUnavailable, match="writable by group or others"):
        _kernel().load()


@needs_compiler
def test_ci_fails_on_a_broken_kernel_source_and_passes_on_the_real_one(tmp_path):
    """The real thing, as CI runs it: a copy of tr_serve whose top-k kernel source (kernels/csrc/top_k.c) is
    broken on purpose, and the top-k tests under TR_SERVE_REQUIRE_KERNELS=1 with a fresh kernel
    directory. They fail (they do not skip); without the variable they skip; the real source passes."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "tr_serve", copy / "tr_serve", ignore=shutil.ignore_patterns("__pycache__"))
    top_k = copy / "tr_serve" / "kernels" / "csrc" / "top_k.c"
    text = top_k.read_text()
    assert "int tr_top_k(" in text
    top_k.write_text(text.replace("int tr_top_k(", "int broken_on_purpose = ;\nint tr_top_k(", 1))

    def pytest_run(src: Path, required: bool) -> subprocess.CompletedProcess:
        # (not from ROOT: `python -m` puts the working directory, and so its tr_serve, first on the path)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(ROOT)]),
                   **{native.KERNEL_CACHE_ENV: str(tmp_path / "kernels")})
        env.pop(native.REQUIRE_ENV, None)
        if required:
            env[native.REQUIRE_ENV] = "1"
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                               str(ROOT / "tests" / "kernels" / "test_top_k.py")], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)

    broken = pytest_run(copy, required=True)
    assert broken.returncode != 0, broken.stdout[-3000:]
    assert "KernelUnavailable" in broken.stdout and "broken_on_purpose" in broken.stdout, broken.stdout[-3000:]
    assert "failed" in broken.stdout.splitlines()[-1] and "skipped" not in broken.stdout.splitlines()[-1]
    skipped = pytest_run(copy, required=False)
    assert skipped.returncode == 0 and "skipped" in skipped.stdout.splitlines()[-1], skipped.stdout[-3000:]
    real = pytest_run(ROOT, required=True)
    assert real.returncode == 0 and "skipped" not in real.stdout.splitlines()[-1], real.stdout[-3000:]
