"""How many threads a small decode step runs with: all of them, or one.

Why: a small-batch CPU decode step is ~180 OpenMP barriers (five per fused
layer). On an idle machine two threads stream the weights faster than one;
when other processes share the cores, every barrier waits for a thread that
lost its core, and the same step took 217-250 ms with two threads against
~35 ms with one (docs/cpu.md, "Two threads on shared cores"). Which one wins
depends on the machine's load at the time, so the shard measures both: it
runs small decode steps with the count whose recent steps were faster, and
every EXPLORE_EVERY steps tries the other once. The result does not depend
on the count (each row of the compiled kernels is computed by one thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Steps between two tries of the count not in use: rare enough that a try of
# a 6x slower count costs a few percent, frequent enough to follow the load.
EXPLORE_EVERY = 64
# Weight of the newest step in a count's running estimate.
ALPHA = 0.3


@dataclass
class ThreadChoice:
    """Running per-count step-time estimates (ns) for the small decode steps of one shard."""

    counts: tuple[int, ...]  # (all threads, 1)
    estimate: dict[int, float] = field(default_factory=dict)
    steps: int = 0

    def pick(self) -> int:
        """The count for the next eligible step."""
        return choose(self.counts, self.estimate, self.steps)

    def record(self, threads: int, ns: int) -> None:
        """A step's time. A try of the count not in use replaces its estimate (the one sample of
        the present load it has), so the choice swings back within one try when the load drops."""
        self.steps += 1
        old = self.estimate.get(threads)
        in_use = old is not None and old <= min(self.estimate.values())
        self.estimate[threads] = (1 - ALPHA) * old + ALPHA * ns if in_use else float(ns)


def choose(counts: tuple[int, ...], estimate: dict[int, float], steps: int) -> int:
    """Untried counts first (in order), then the faster estimate, but the slower one on
    every EXPLORE_EVERY-th step."""
    for c in counts:
        if c not in estimate:
            return c
    ranked = sorted(counts, key=lambda c: estimate[c])
    if steps % EXPLORE_EVERY == EXPLORE_EVERY - 1 and len(ranked) > 1:
        return ranked[1]
    return ranked[0]


def thread_counts(configured: int) -> tuple[int, ...]:
    """The counts compared: the configured one and 1 (nothing to compare with one thread)."""
    return (configured, 1) if configured > 1 else (configured,)
