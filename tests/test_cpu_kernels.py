"""The compiled CPU matvec kernel against torch's linear (skipped where it cannot be built)."""

import pytest
import torch
import torch.nn.functional as F

from pagemill.cpu_kernels import matvec_kernel
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
