"""Load shapes as pure functions of elapsed time, so they are tested without Locust.

- steady: `users` from the start (spawned at `spawn_rate` per second) until `run_time`.
- steps: a step ramp: `step_users` more users every `step_time` seconds, up to `users`, until
  `run_time` (or, without one, until the last step has run for `step_time`).
- Poisson arrivals (open loop) are not a user count: `arrival_gaps` gives the waits between request
  starts for a target rate, and the locustfile's users start requests on that clock without waiting
  for answers (closed-loop users cap throughput at users / latency).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

SHAPES = ("steady", "steps")


@dataclass(frozen=True)
class ShapePlan:
    shape: str
    users: int
    spawn_rate: float
    run_time_s: float | None
    step_users: int = 0
    step_time_s: float = 0.0

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}: choose from {', '.join(SHAPES)}")
        if self.shape == "steps" and (self.step_users < 1 or self.step_time_s <= 0):
            raise ValueError("the steps shape needs --step-users >= 1 and --step-time > 0")

    def at(self, elapsed_s: float) -> tuple[int, float] | None:
        """(user count, spawn rate) at `elapsed_s` into the test, or None when it is over."""
        if self.shape == "steady":
            if self.run_time_s is not None and elapsed_s >= self.run_time_s:
                return None
            return self.users, self.spawn_rate
        steps = math.ceil(self.users / self.step_users)
        end = self.run_time_s if self.run_time_s is not None else steps * self.step_time_s
        if elapsed_s >= end:
            return None
        step = int(elapsed_s // self.step_time_s) + 1
        # Each step spawns within its first second at most, so the step's level is held for the rest of it.
        return min(self.users, step * self.step_users), max(self.spawn_rate, float(self.step_users))


def arrival_gaps(rate_per_s: float, rng: random.Random) -> Iterator[float]:
    """Waits between arrivals of a Poisson process of `rate_per_s` (exponentially distributed)."""
    if rate_per_s <= 0:
        raise ValueError("arrival rate must be positive")
    while True:
        yield rng.expovariate(rate_per_s)
