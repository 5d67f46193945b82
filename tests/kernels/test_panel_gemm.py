"""The panel GEMM: compiled on this machine, the same fp32 function as F.linear (to rounding),
batch invariant (a row's result does not depend on the other rows), optional everywhere."""

from __future__ import annotations

import stat

import pytest
import torch
import torch.nn.functional as F

from tr_serve.kernels import native
from tr_serve.kernels import panel_gemm as pg
from tests.kernel_testutil import needs_kernel as _needs

needs_kernel = _needs(pg.KERNEL)


def test_pack_layout():
    w = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    p = pg.pack(w)
    assert p.shape == (2, 3, 16)  # 20 outputs padded to two panels of 16
    assert torch.equal(p[0, :, :], w[:16].T) and torch.equal(p[1, :, :4], w[16:].T)
    assert not p[1, :, 4:].any()


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16, 17, 18, 20, 40])
@pytest.mark.parametrize("n,k", [(96, 40), (20, 130), (48, 300)])
def test_matches_f_linear(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    got = pg.linear(x, pg.pack(w), n, b)
    assert got.shape == (m, n) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    x3 = x.reshape(1, m, k)  # leading dims kept
    assert pg.linear(x3, pg.pack(w), n).shape == (1, m, n)


@needs_kernel
def test_batch_invariant_and_strided_input():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 200, generator=g), torch.randn(16, 200, generator=g)
    p = pg.pack(w)
    full = pg.linear(x, p, 64)
    for m in (1, 3, 8, 16):
        assert torch.equal(pg.linear(x[:m], p, 64), full[:m])  # bit for bit, whatever the other rows
    assert torch.equal(pg.linear(x[5:6], p, 64)[0], full[5])
    more = torch.cat([x, torch.randn(24, 200, generator=g)])  # 40 rows: chunks of 16, 16 and 8
    assert torch.equal(pg.linear(more, p, 64)[:16], full)
    assert torch.equal(pg.linear(more, p, 64)[16:], pg.linear(more[16:], p, 64))
    # a last chunk of 1-8 rows after a full one: those rows as they come alone (80 outputs: 5 panels)
    w5 = torch.randn(80, 200, generator=g)
    p5 = pg.pack(w5)
    alone = pg.linear(more[16:], p5, 80)
    for m in (17, 18, 19, 20, 24):
        got = pg.linear(more[:m], p5, 80)
        assert torch.equal(got[:16], pg.linear(x, p5, 80)) and torch.equal(got[16:], alone[: m - 16])
    wide = torch.randn(16, 400, generator=g)
    wide[:, ::2] = x  # a strided view with row stride 400
    assert torch.equal(pg.linear(wide[:, ::2].contiguous(), p, 64), full)
    # rows with a stride past K, straight into the kernel (the decoder layers' C loop passes row strides)
    wide[:, :200] = x
    for m in (1, 8, 16):
        y = torch.empty(m, 64)
        assert pg.load().tr_panel_gemm(wide.data_ptr(), 400, p.data_ptr(), y.data_ptr(), 64, m, 200, 4,
                                       torch.get_num_threads()) == 0
        assert torch.equal(y, full[:m])


def assert_each_row_as_alone(w: torch.Tensor, x: torch.Tensor, counts, threads: int) -> torch.Tensor:
    """With ``threads`` threads, the first m rows of ``x`` (for each m in ``counts``) give every row
    its result alone, bit for bit; returns the rows' results alone."""
    n = w.shape[0]
    p = pg.pack(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([pg.linear(x[r : r + 1], p, n) for r in range(x.shape[0])])
        for m in counts:
            assert torch.equal(pg.linear(x[:m], p, n), alone[:m]), m
    finally:
        torch.set_num_threads(before)
    return alone


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [16, 32, 48, 64, 80, 96, 112, 128, 208, 1000])
def test_up_to_sixteen_rows_give_each_rows_result_alone(n, threads):
    """Up to 6 rows and 9 run 4 or 3 panels per group by the row count, 7-8 and 13-16 rows 6 panels
    with the rows in blocks of 4, 10-12 rows 3 panels with the rows in blocks of 8, both over
    sub-blocks of 64 k (K = 300: two whole blocks of 128, then 44 k, a short one), and each
    thread's run of panels ends in smaller groups: every row count gives each row its own result
    (one row alone) bit for bit, for every remainder of panels per thread."""
    g = torch.Generator().manual_seed(n + 3)
    w, x = torch.randn(n, 300, generator=g), torch.randn(16, 300, generator=g)
    alone = assert_each_row_as_alone(w, x, range(2, 17), threads)
    torch.testing.assert_close(alone, F.linear(x, w), rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [16, 48, 96, 208])
def test_both_row_blocks_for_13_to_16_rows_give_each_rows_result_alone(n, threads):
    """13-16 rows in blocks of 4 over 6 panels (the default) or of 8 over 3 (set_wide_narrow(False),
    the kernel plan's choice on CPUs where that is faster): the same sums in the same order, so every
    row's result is its own, bit for bit, under either setting, and the setting can be switched back."""
    g = torch.Generator().manual_seed(n + 11)
    w, x = torch.randn(n, 300, generator=g), torch.randn(16, 300, generator=g)
    try:
        pg.set_wide_narrow(False)
        split = assert_each_row_as_alone(w, x, range(13, 17), threads)
        pg.set_wide_narrow(True)
        narrow = assert_each_row_as_alone(w, x, range(13, 17), threads)
    finally:
        pg.set_wide_narrow(True)
    assert torch.equal(split, narrow)
    p = pg.pack(w)
    pg.set_wide_narrow(False)
    try:
        assert torch.equal(pg.linear(x, p, n), narrow)
    finally:
        pg.set_wide_narrow(True)
    assert pg._wide_narrow is True


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_prefetch_into_l2_gives_the_same_results(threads):
    """A prefetch into L2 instead of L1 (set_prefetch_l2, per row count, the kernel plan's choice on
    CPUs where it is faster) changes no result: every path (groups of 1-6 and 9 rows, blocks of 4
    and of 8) gives the same bits, rows past the library's table (64) stay on L1."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(208, 300, generator=g), torch.randn(72, 300, generator=g)
    p = pg.pack(w)
    counts = (1, 2, 4, 5, 6, 7, 8, 9, 10, 12, 13, 16, 17, 24, 64, 72)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        l1 = {m: pg.linear(x[:m], p, 208) for m in counts}
        pg.set_prefetch_l2(counts)
        assert pg._prefetch_l2 == frozenset(c for c in counts if c <= pg.PREFETCH_L2_MAX_ROWS)
        for m in counts:
            assert torch.equal(pg.linear(x[:m], p, 208), l1[m]), m
    finally:
        pg.set_prefetch_l2(())
        torch.set_num_threads(before)
    assert pg._prefetch_l2 == frozenset()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [16, 32, 48, 64, 80, 128, 192, 208, 576])
def test_rows_past_sixteen_give_each_rows_result_alone(n, threads):
    """Past 16 rows the rows run in blocks of up to 8, shared out evenly (x transposed in chunks of
    one block each), 3 panels at a time and the thread's last 1 or 2 panels together, over
    sub-blocks of 64 k up to 24 rows and whole 128-k blocks past that: every row's result is still
    bit for bit the row's own, for every remainder of rows and panels."""
    g = torch.Generator().manual_seed(n + 7)
    w, x = torch.randn(n, 136, generator=g), torch.randn(41, 136, generator=g)
    alone = assert_each_row_as_alone(w, x, (17, 18, 19, 20, 21, 24, 25, 32, 33, 36, 41), threads)
    torch.testing.assert_close(alone, F.linear(x, w), rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [48, 208])
def test_every_balanced_row_block_count_gives_each_rows_result_alone(n, threads):
    """10-12 rows and 17-128 share their rows out evenly over as many blocks as blocks of 8 need
    (17: 6 + 6 + 5; above 16 rows x is transposed in chunks of one block each), with the prefetches
    of the blocks' passes spread over every line: each count gives each row its own result."""
    g = torch.Generator().manual_seed(n + 13)
    w, x = torch.randn(n, 200, generator=g), torch.randn(128, 200, generator=g)
    assert_each_row_as_alone(w, x, [*range(10, 13), *range(17, 129)], threads)


def test_unavailable_without_a_compiler(monkeypatch):
    monkeypatch.delenv(native.REQUIRE_ENV, raising=False)  # (required, it raises: test_native.py)
    monkeypatch.setattr(pg.KERNEL, "tried", False)
    monkeypatch.setattr(pg.KERNEL, "lib", None)
    monkeypatch.setattr(pg.KERNEL, "why_not", "")
    monkeypatch.setattr(pg, "_compiler", lambda: None)
    assert pg.load() is None
    with pytest.raises(RuntimeError):
        pg.linear(torch.randn(1, 4), pg.pack(torch.randn(16, 4)), 16)


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setattr(pg.KERNEL, "tried", False)
    monkeypatch.setattr(pg.KERNEL, "lib", None)
    monkeypatch.setenv("TR_SERVE_PANEL_GEMM", "0")
    assert pg.load() is None


@needs_kernel
def test_built_once_into_the_kernel_cache_not_tr_serve_cache(tmp_path, monkeypatch):
    """Built into TR_SERVE_KERNEL_CACHE (0700), never into TR_SERVE_CACHE (weights and plans, maybe a
    shared volume), then reused."""
    shared, kernels = tmp_path / "shared", tmp_path / "private" / "kernels"
    monkeypatch.setenv("TR_SERVE_CACHE", str(shared))
    monkeypatch.setenv(native.KERNEL_CACHE_ENV, str(kernels))
    monkeypatch.setattr(pg.KERNEL, "tried", False)
    monkeypatch.setattr(pg.KERNEL, "lib", None)
    assert pg.load() is not None
    [lib] = kernels.glob(f"{native.LIBRARY_NAME}-*.so")  # every kernel's C in one library
    assert stat.S_IMODE(kernels.stat().st_mode) == 0o700 and not stat.S_IMODE(lib.stat().st_mode) & 0o022
    assert [p.name for p in kernels.iterdir()] == [lib.name]  # sources and temporaries cleaned up
    assert not list(tmp_path.glob("shared/**/*.so"))
    stamp = lib.stat().st_mtime_ns
    monkeypatch.setattr(pg.KERNEL, "tried", False)
    monkeypatch.setattr(pg.KERNEL, "lib", None)
    monkeypatch.setattr(native.KERNELS, "_opened", {})  # as a new process finds it
    assert pg.load() is not None and lib.stat().st_mtime_ns == stamp  # reused, not rebuilt


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_past_128_run_in_ranges_and_give_each_rows_result_alone(threads):
    """Past 128 rows a group of panels takes its rows 128 at a time (its scratch lives on the
    thread's stack): the rows of the second range are still each row's own result."""
    g = torch.Generator().manual_seed(11)
    w, x = torch.randn(80, 136, generator=g), torch.randn(150, 136, generator=g)
    assert_each_row_as_alone(w, x, (128, 129, 137, 150), threads)
