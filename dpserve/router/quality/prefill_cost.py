"""What one more uncached prompt token costs a request, learned from the live requests: a least-squares line
of each request's time on its replica against the prompt tokens its replica had to compute. The slope is
the prefill time per token as this fleet serves it (queueing included), the one term of a request's time
that a routing choice changes. The shadows use it to hold a choice that would have missed more for longer
(`router/quality/shadows.py`)."""

from __future__ import annotations


class PrefillCost:
    """An exponentially weighted least-squares fit of seconds against uncached tokens."""

    def __init__(self, half_life: int = 512) -> None:
        """`half_life`: requests after which one's weight is halved (the fleet's speed drifts with load)."""
        self._keep = 0.5 ** (1.0 / half_life)
        self._weight = 0.0
        self._x = 0.0
        self._y = 0.0
        self._xx = 0.0
        self._xy = 0.0

    def learn(self, uncached_tokens: float, seconds: float) -> None:
        keep = self._keep
        self._weight = self._weight * keep + 1.0
        self._x = self._x * keep + uncached_tokens
        self._y = self._y * keep + seconds
        self._xx = self._xx * keep + uncached_tokens * uncached_tokens
        self._xy = self._xy * keep + uncached_tokens * seconds

    @property
    def seconds_per_token(self) -> float:
        """0 until requests with different uncached counts were seen, and never below 0 (a workload whose
        longer prompts happen to finish sooner says nothing about prefill)."""
        weight = self._weight
        if weight < 2:
            return 0.0
        mean_x = self._x / weight
        spread = self._xx / weight - mean_x * mean_x
        if spread <= 1e-9 * max(1.0, mean_x * mean_x):
            return 0.0
        slope = (self._xy / weight - mean_x * self._y / weight) / spread
        return max(0.0, slope)
