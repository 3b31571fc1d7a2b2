"""The compiled greedy sampler (cpu_kernels/csrc/rowwise/greedy.cpp) against Sampler's torch path.

Same token (first maximum on ties, as torch.argmax) and the same logprob to
float32 rounding of a 49152-term sum; rows with NaN/inf go back to torch; a
batch with anything but plain greedy rows never takes the kernel.
"""

from __future__ import annotations

import pytest
import torch
from test_sampling import VOCAB, Row

from pagemill.cpu_kernels.build import build_library
from pagemill.cpu_kernels.rowwise import GreedyKernel, greedy_kernel
from pagemill.sampling import Sampler, SamplingParams

kernel = greedy_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ compiler / not x86-64 Linux")


@pytest.fixture(scope="module", params=["native", "no-avx512f"])
def greedy(request):
    if request.param == "native":
        return kernel
    lib = build_library(("-mno-avx512f",))
    assert lib is not None
    return GreedyKernel(lib)


def logits_with_ties(rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    x = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    x[0, min(5, vocab - 2)] = x[0, vocab - 1] = x[0].max() + 1  # a tie: the first index wins
    x[1, :] = 0.25  # all equal
    if vocab > 70 and rows > 2:  # a tie between two lanes, the later index in the lower lane
        x[2, 20] = x[2, 70] = x[2].max() + 1
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 1000, 17, 3])
def test_matches_the_torch_path(greedy, dtype, vocab):
    x = logits_with_ties(6, vocab, dtype)
    rows = [Row(SamplingParams()) for _ in range(6)]
    ref = Sampler("cpu")(x, rows)
    ids, lps = greedy(x)
    assert ids.tolist() == ref.token_ids == x.float().argmax(-1).tolist()
    assert ids[0] == min(5, vocab - 2) and ids[1] == 0 and (vocab <= 70 or ids[2] == 20)
    torch.testing.assert_close(lps, torch.tensor(ref.logprobs), rtol=1e-5, atol=1e-5)
    out = Sampler("cpu", greedy=greedy)(x, rows)
    assert out.token_ids == ref.token_ids and out.top_ids == ref.top_ids


def test_strided_rows(greedy):
    x = logits_with_ties(4, 2000, torch.float32)[:, :1500]  # a view: row stride 2000
    ids, lps = greedy(x)
    assert ids.tolist() == x.argmax(-1).tolist()
    torch.testing.assert_close(lps, (x.max(-1).values - x.logsumexp(-1)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rows_go_back_to_torch(greedy, bad):
    x = logits_with_ties(3, 100, torch.float32)
    x[2, 40] = bad
    assert greedy(x) is None
    rows = [Row(SamplingParams()) for _ in range(3)]
    assert Sampler("cpu", greedy=greedy)(x, rows).token_ids == Sampler("cpu")(x, rows).token_ids


def test_other_rows_keep_the_torch_path():
    class Refuse:
        def __call__(self, logits):
            raise AssertionError("the kernel ran for a batch it does not handle")

    x = logits_with_ties(2, VOCAB, torch.float32)
    sampler = Sampler("cpu", seed=0, greedy=Refuse())
    sampler(x, [Row(SamplingParams()), Row(SamplingParams(temperature=0.7, do_sample=True))])
    sampler(x, [Row(SamplingParams()), Row(SamplingParams(), top_n=2)])
    sampler(x, [Row(SamplingParams(logit_bias=((3, 5.0),))), Row(SamplingParams())])
    sampler(x, [Row(SamplingParams(repetition_penalty=1.2)), Row(SamplingParams())])
    sampler(x, [Row(SamplingParams()), Row(SamplingParams())], banned={0: [1]})


@pytest.mark.parametrize("rows", [5, 6, 40])  # 6 rows of 49152: the first that split over the team
def test_rows_split_over_the_team_give_one_threads_bits(greedy, rows):
    x = logits_with_ties(rows, 49152, torch.bfloat16)
    bad = x.clone()
    bad[rows - 2, 7] = float("nan")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = greedy(x)
        torch.set_num_threads(2)
        team = greedy(x)
        refused = greedy(bad)  # a bad row in the split pass still sends the batch to torch
    finally:
        torch.set_num_threads(before)
    assert refused is None
    assert one[0].tolist() == x.float().argmax(-1).tolist()
    assert torch.equal(one[0], team[0]) and torch.equal(one[1], team[1])
