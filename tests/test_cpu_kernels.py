"""The compiled CPU matvec kernel against torch's linear, and the plain read the benchmarks' floors
use (skipped where the library cannot be built)."""

import time

import pytest
import torch
import torch.nn.functional as F

from pagemill.cpu_kernels.matvec import matvec_kernel

from pagemill.cpu_kernels.read_rate import plain_read
from pagemill.models.packed_linear import MATVEC_MAX_ROWS, PackedLinear

kernel = matvec_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C++ compiler / not x86-64 Linux")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("n,k", [(960, 576), (577, 1536), (7, 17), (1, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    torch.testing.assert_close(kernel(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_rejects_more_rows_than_it_handles():
    with pytest.raises(ValueError):
        kernel(torch.randn(kernel.max_rows + 1, 16), torch.randn(4, 16), None)


@needs_kernel
def test_packed_linear_uses_it_for_decode_rows_only():
    lin = PackedLinear(576, 960, bias=True)
    lin.pack()
    assert lin.matvec is kernel
    with torch.inference_mode():
        for rows in (1, MATVEC_MAX_ROWS, MATVEC_MAX_ROWS + 1, 300):
            x = torch.randn(rows, 576)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)
        # A non-contiguous input (a column slice) is made contiguous first.
        x = torch.randn(1, 1152)[:, ::2]
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)


def test_no_cpu_kernels_keeps_torch_linear():
    """`--no-cpu-kernels` (ShardConfig.cpu_kernels=False) never builds or uses the kernel."""
    lin = PackedLinear(64, 32, bias=False)
    lin.pack(cpu_kernels=False)
    assert lin.matvec is None
    with torch.inference_mode():
        x = torch.randn(1, 64)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("numel", [1, 15, 16, 17, 1000, 4096 + 7])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_plain_read_sums_every_float_once(numel, threads, monkeypatch):
    read = plain_read()
    if read is None:
        pytest.skip("cpu kernels unavailable")
    x = torch.arange(numel, dtype=torch.float32) % 7 - 3  # small integers: the float sums are exact
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert read(x) == float(x.sum())
    finally:
        torch.set_num_threads(prev)


def test_roofline_reads_at_the_faster_readers_rate(monkeypatch):
    import pagemill.bench.roofline as roofline

    calls = []

    def slow_read(t):  # a reader slower than torch's sum does not lower the rate
        calls.append(t.numel())
        time.sleep(0.05)
        return 0.0

    monkeypatch.setattr(roofline, "plain_read", lambda: slow_read)
    m = roofline.measure_machine(buffer_mib=4, mm_size=64, repeats=2)
    assert calls and all(n == 4 * (1 << 20) // 4 for n in calls)
    assert m.sum_gbs > 4 * (1 << 20) / 0.05 / 1e9  # torch's sum of 4 MiB is far faster than 50 ms
    monkeypatch.setattr(roofline, "plain_read", lambda: None)  # no compiled library: torch's sum alone
    assert roofline.measure_machine(buffer_mib=4, mm_size=64, repeats=2).sum_gbs > 0
