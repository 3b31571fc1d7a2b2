"""Exact verification of speculative proposals (Leviathan et al. 2023; Chen et al. 2023).

For proposal x_j drawn from q_j, accept with probability min(1, p_j(x_j) / q_j(x_j));
at the first rejection draw the replacement from norm(max(0, p_j - q_j)); when
all k are accepted draw a bonus token from p_k. The returned tokens are then
distributed exactly as k + 1 (or fewer) draws from the target p. An n-gram
proposal is a point mass (q = 1 at x), so it is accepted with probability
p(x) and the residual is p with x removed. Greedy rows have one-hot p (and
one-hot q from a greedy draft): "accept while the proposal is the argmax".
All requests are verified together as one padded [R, K] problem.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagemill.sampling.sampler import Sampler, SamplingRow


def verify(
    sampler: Sampler,
    target: torch.Tensor,
    counts: Sequence[int],
    proposals: Sequence[Sequence[int]],
    rows: Sequence[SamplingRow],
    draft: torch.Tensor | None = None,
) -> list[list[int]]:
    """Tokens to emit per request: accepted proposals, then one correction/bonus token.

    target [N, V]: target distribution of every fed position; request r owns
    counts[r] = len(proposals[r]) + 1 consecutive rows. draft [R, K, V]: the
    draft's distributions q_j (padded to K = max proposals), None for point
    masses. rows: one per request.
    """
    dev = target.device
    num, width = len(counts), max(counts) - 1
    n = torch.tensor([c - 1 for c in counts], device=dev)
    offsets = torch.tensor([0] + list(counts[:-1]), device=dev).cumsum(0)
    cols = torch.arange(width + 1, device=dev)
    # Row of position j of request r (clamped: padded positions repeat the last row).
    p = target[offsets[:, None] + torch.minimum(cols[None, :], n[:, None])]  # [R, K+1, V]
    # Built on the host and copied once: one small copy per request would cost a sync each.
    d = torch.tensor([list(x) + [0] * (width - len(x)) for x in proposals], dtype=torch.int64)
    d = d.reshape(num, width).to(dev)
    ar = torch.arange(num, device=dev)

    p_x = p[:, :width].gather(2, d[..., None]).squeeze(2)  # [R, K]
    q_x = torch.ones_like(p_x) if draft is None else draft[:, :width].gather(2, d[..., None]).squeeze(2)
    u = sampler.uniform(rows, [c - 1 for c in counts], width)
    ratio = p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)
    ok = (u < ratio) & (cols[None, :width] < n[:, None])
    accepted = ok.int().cumprod(1).sum(1)  # [R] leading accepted proposals

    final = p[ar, accepted]  # [R, V]: bonus distribution where all were accepted
    rejected = accepted < n
    if width > 0 and bool(rejected.any()):
        at = accepted.clamp(max=width - 1)
        if draft is None:
            residual = final.scatter(1, d[ar, at][:, None], 0.0)
        else:
            residual = (final - draft[ar, at]).clamp_min(0.0)
        mass = residual.sum(-1, keepdim=True)
        # mass is > 0 whenever a rejection is possible (p(x) < q(x)); the guard
        # only protects against rounding.
        use = rejected[:, None] & (mass > 0)
        final = torch.where(use, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), final)
    last = sampler.draw(final, rows).tolist()
    accepted = accepted.tolist()
    return [list(proposals[r][: accepted[r]]) + [last[r]] for r in range(num)]
