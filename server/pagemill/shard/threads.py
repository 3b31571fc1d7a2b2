"""How many threads a small decode step runs with: all of them, or one.

Why: a small-batch CPU decode step is ~180 OpenMP barriers (five per fused
layer). On an idle machine two threads stream the weights faster than one;
when other processes share the cores, every barrier waits for a thread that
lost its core, and the same step took 217-250 ms with two threads against
~35 ms with one (docs/cpu.md, "Two threads on shared cores"). Which one wins
depends on the machine's load at the time, so the shard measures both: it
runs small decode steps with the count whose recent steps were faster, and
now and then tries the other once. The result does not depend on the count
(each row of the compiled kernels is computed by one thread).

How often: a try of the slower count costs its extra time (at batch 1 on
an idle 2-vCPU machine one thread took 19 ms against 10.5 for two, 0.13 ms
a step when tried every 64th step). So each try that loses doubles the
steps to the next one, up to EXPLORE_MAX; a try that wins, or estimates
that cross, bring the tries back to every EXPLORE_EVERY steps, and a count
in use whose steps got LOAD_CHANGE slower than at the last try (the load
changed) has the other tried at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Steps between two tries of the count not in use: at first and after a try that won.
EXPLORE_EVERY = 64
# ... doubled after each try that lost, up to this.
EXPLORE_MAX = 1024
# The count in use this much slower than at the last try: try the other at the next step.
LOAD_CHANGE = 1.25
# Weight of the newest step in a count's running estimate.
ALPHA = 0.3


@dataclass
class ThreadChoice:
    """Running per-count step-time estimates (ns) for the small decode steps of one shard."""

    counts: tuple[int, ...]  # (all threads, 1)
    estimate: dict[int, float] = field(default_factory=dict)
    steps: int = 0  # steps since the last try of the count not in use
    every: int = EXPLORE_EVERY  # steps from one try to the next
    at_try: float = 0.0  # the estimate of the count in use when the other was last tried
    in_use: int = 0  # the count whose estimate was the lower at its last step

    def pick(self) -> int:
        """The count for the next eligible step."""
        return choose(self.counts, self.estimate, self.steps, self.every, self.at_try)

    def record(self, threads: int, ns: int) -> None:
        """A step's time. A try of the count not in use replaces its estimate (the one sample of
        the present load it has), so the choice swings back within one try when the load drops."""
        old = self.estimate.get(threads)
        if old is not None and old <= min(self.estimate.values()):  # the count in use
            if threads != self.in_use:  # the estimates crossed: the load changed
                self.in_use, self.every, self.steps = threads, EXPLORE_EVERY, 0
            self.estimate[threads] = (1 - ALPHA) * old + ALPHA * ns
            self.steps += 1
            return
        others = [v for c, v in self.estimate.items() if c != threads]
        self.estimate[threads] = float(ns)
        if old is None or not others:  # a first try: nothing to compare yet
            return
        won = ns < min(others)
        self.every = EXPLORE_EVERY if won else min(2 * self.every, EXPLORE_MAX)
        self.steps = 0
        self.at_try = min(self.estimate.values())


def choose(counts: tuple[int, ...], estimate: dict[int, float], steps: int, every: int = EXPLORE_EVERY,
           at_try: float = 0.0) -> int:  # fmt: skip
    """Untried counts first (in order), then the faster estimate, but the slower one after
    `every` steps of the faster (`steps` since the last try), or at once when the faster's
    estimate has grown LOAD_CHANGE-fold since that try (`at_try`)."""
    for c in counts:
        if c not in estimate:
            return c
    ranked = sorted(counts, key=lambda c: estimate[c])
    if len(ranked) > 1 and (steps >= every - 1 or (at_try > 0 and estimate[ranked[0]] > LOAD_CHANGE * at_try)):
        return ranked[1]
    return ranked[0]


def thread_counts(configured: int) -> tuple[int, ...]:
    """The counts compared: the configured one and 1 (nothing to compare with one thread)."""
    return (configured, 1) if configured > 1 else (configured,)
