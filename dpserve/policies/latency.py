"""How long a replica will take: time to first token (TTFT) and time per output token (TPOT), predicted per
replica from what the router already sees, and learned online from each answer.

TTFT on one replica is modelled as a line in what stands before the first token:

    ttft = a                       # the fixed cost: the round trip, scheduling, the first decode step
         + b * own / 1000          # this request's uncached prompt tokens there
         + c * ahead / 1000        # those of the requests sent there that have not begun answering (an
                                   # engine that computes prompts one batch at a time makes this one wait
                                   # for them; one that computes them side by side hardly does: learned)
         + d * busy                # requests it is decoding meanwhile (each step is longer with more)
         + e * queued              # requests beyond its slots (vLLM's max_num_seqs): this one waits for
                                   # one of them to end

and TPOT as `f + g * busy`. Each replica has its own weights, so a slower GPU, a TP replica or a CPU
replica is each known for what it is. They are fitted by recursive least squares with forgetting (a
least-squares fit updated in O(n²) per answer, recent answers weighing most, so a replica whose speed
changes is followed), starting from a weak prior so the first requests have a prediction. No I/O: the
router's latency watch (`router/quality/latency_watch.py`) feeds it; policies read it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

TTFT_PRIOR = (0.05, 0.2, 0.1, 0.005, 0.2)
"""Seconds: fixed, per 1000 own tokens, per 1000 tokens ahead, per request decoding, per request queued
beyond the slots. A
guess of the right size for a small model (vLLM CPU's tiny model, a GPU's 8B); a few answers correct it."""
TPOT_PRIOR = (0.01, 0.001)
"""Seconds per output token: alone, and more per other request decoding."""
TTFT_TYPICAL = (1.0, 1.0, 1.0, 4.0, 1.0)
TPOT_TYPICAL = (1.0, 4.0)
"""The inputs' usual sizes (the constant, thousands of own tokens and of tokens ahead, requests busy and
queued)."""
PRIOR_ANSWERS = 2.0
"""How many answers the prior weighs as: enough to keep the first fits sane, little enough to yield fast."""
FORGET = 0.99
"""Each answer's weight shrinks by this per later answer: about the last 70 answers dominate."""
ERRORS_KEPT = 256
MEDIAN_STEP = 0.05
"""How far one answer moves a replica's TTFT calibration (a factor of e^0.05 up or down): the median of
realized over predicted is found in some tens of answers, and followed."""
MIN_SECONDS = 0.001
"""The least a prediction counts as when an answer is weighed by it."""


class OnlineFit:
    """A linear model fitted by recursive least squares with exponential forgetting."""

    __slots__ = ("_cap", "_forget", "_p", "samples", "weights")

    def __init__(self, prior: Sequence[float], typical: Sequence[float], forget: float = FORGET) -> None:
        """`prior`: the starting weights; `typical`: each input's usual size. The prior then weighs as
        `PRIOR_ANSWERS` answers of usual inputs (least squares weighs an input by its square)."""
        size = len(prior)
        self.weights = list(prior)
        self._forget = forget
        self._p = [
            [1.0 / (PRIOR_ANSWERS * typical[i] ** 2) if i == j else 0.0 for j in range(size)] for i in range(size)
        ]
        self._cap = [self._p[i][i] * 100.0 for i in range(size)]
        """Forgetting inflates the uncertainty of a feature that never varies: bounded, so one that starts
        to vary later does not swing the fit."""
        self.samples = 0

    def predict(self, inputs: Sequence[float]) -> float:
        """The fitted line at `inputs`; slopes below 0 read as 0 (more work never makes a replica faster:
        a negative slope is noise or a confounded fit), and never below 0 in all."""
        weights = self.weights
        total = weights[0] * inputs[0]
        for i in range(1, len(weights)):
            weight = weights[i]
            if weight > 0.0:
                total += weight * inputs[i]
        return total if total > 0.0 else 0.0

    def learn(self, inputs: Sequence[float], observed: float) -> None:
        """One more answer. Each is weighed by the inverse of its prediction (least squares of the relative
        error): latencies spread in proportion to their size, and a few slow answers under a burst must
        not drag every short prediction up (on vLLM CPU under load: median error 0.29 unweighted)."""
        scale = 1.0 / max(self.predict(inputs), observed * 0.25, MIN_SECONDS)
        inputs = [value * scale for value in inputs]
        observed *= scale
        p, weights, forget = self._p, self.weights, self._forget
        size = len(weights)
        px = [sum(p[i][j] * inputs[j] for j in range(size)) for i in range(size)]
        denominator = forget + sum(inputs[i] * px[i] for i in range(size))
        gain = [value / denominator for value in px]
        error = observed - sum(weights[i] * inputs[i] for i in range(size))
        for i in range(size):
            weights[i] += gain[i] * error
        for i in range(size):
            row = p[i]
            for j in range(size):
                row[j] = (row[j] - gain[i] * px[j]) / forget
            if row[i] > self._cap[i]:
                scale = (self._cap[i] / row[i]) ** 0.5
                for j in range(size):  # shrinks the row and column alike: P stays symmetric, positive
                    row[j] *= scale
                    p[j][i] *= scale
        self.samples += 1


class ReplicaLatency:
    """One replica's latency model, and what the router has sent it that has not begun answering."""

    __slots__ = (
        "errors",
        "prefill_tokens",
        "prefilling",
        "slo_bound",
        "slo_prefill_tokens",
        "slo_prefilling",
        "tpot",
        "ttft",
        "ttft_scale",
    )

    def __init__(self) -> None:
        self.ttft = OnlineFit(TTFT_PRIOR, TTFT_TYPICAL)
        self.ttft_scale = 1.0
        """The fit's line times this is the prediction: a least-squares line is the mean, and latencies
        under load spread with a long tail, so the mean overshoots the typical answer; this factor, moved a
        step towards each answer, settles where half the answers come sooner (the median)."""
        self.tpot = OnlineFit(TPOT_PRIOR, TPOT_TYPICAL)
        self.prefill_tokens = 0
        """Uncached prompt tokens of the requests sent there and not yet answering."""
        self.prefilling = 0
        """Those requests."""
        self.slo_bound = 0
        """Requests with an SLO sent there and not yet done: what a best-effort request would slow."""
        self.slo_prefill_tokens = 0
        self.slo_prefilling = 0
        """Those of `prefill_tokens` and `prefilling` with an SLO: all that is ahead of one more with an SLO
        where vLLM serves them first (`--vllm-priority`)."""
        self.errors: deque[float] = deque(maxlen=ERRORS_KEPT)
        """Recent (predicted - realized) / realized TTFT, for `/status`."""

    def predict_ttft(self, inputs: Sequence[float]) -> float:
        """Seconds to the first token for a request with these inputs (`ttft_inputs`)."""
        return self.ttft_scale * self.ttft.predict(inputs)

    def learn_ttft(self, inputs: Sequence[float], predicted: float, realized: float) -> None:
        """A stream's first event came `realized` seconds after its send; `predicted` was said for it."""
        self.ttft.learn(inputs, realized)
        self.ttft_scale *= _UP if realized > predicted else _DOWN
        if realized > 0:
            self.errors.append((predicted - realized) / realized)

    def ttft_inputs(
        self, uncached_tokens: int, load: int, capacity: int, first: bool = False, when_free: bool = False
    ) -> tuple[float, float, float, float, float]:
        """The TTFT model's inputs for one more request of `uncached_tokens` sent now, on a replica with
        `load` requests (the router's, its peers' and others') and `capacity` slots (0: not known). `first`:
        the replica serves it before the best-effort requests waiting there (vLLM's priority scheduling),
        so only those answering and those with an SLO are ahead of it. `when_free`: sent once a slot is
        free (after a wait in the router's queue): none queued there ahead of it."""
        busy = load - self.prefilling
        if busy < 0:
            busy = 0
        if first:
            ahead_tokens, ahead = self.slo_prefill_tokens, busy + self.slo_prefilling
        else:
            ahead_tokens, ahead = self.prefill_tokens, load
        queued = ahead + 1 - capacity if capacity > 0 and not when_free else 0
        return (
            1.0,
            uncached_tokens / 1000.0,
            ahead_tokens / 1000.0,
            float(busy),
            float(queued if queued > 0 else 0),
        )

    def tpot_inputs(self, load: int) -> tuple[float, float]:
        """The TPOT model's inputs for one more request decoding beside the replica's `load`."""
        return (1.0, float(load if load > 0 else 0))

    def sent(self, uncached_tokens: int, slo_bound: bool) -> None:
        self.prefill_tokens += uncached_tokens
        self.prefilling += 1
        if slo_bound:
            self.slo_bound += 1
            self.slo_prefill_tokens += uncached_tokens
            self.slo_prefilling += 1

    def answering(self, uncached_tokens: int, slo_bound: bool) -> None:
        """A request sent there began answering (or ended before it did): its prompt is computed."""
        self.prefill_tokens = max(0, self.prefill_tokens - uncached_tokens)
        self.prefilling = max(0, self.prefilling - 1)
        if slo_bound:
            self.slo_prefill_tokens = max(0, self.slo_prefill_tokens - uncached_tokens)
            self.slo_prefilling = max(0, self.slo_prefilling - 1)

    def done(self, slo_bound: bool) -> None:
        if slo_bound:
            self.slo_bound = max(0, self.slo_bound - 1)

    def chance_within(self, limit_s: float, predicted_s: float) -> float:
        """The share of this replica's recent streams that, predicted `predicted_s`, would have come within
        `limit_s` (from their realized / predicted ratios); 0.5 for the median prediction itself, and 0.5
        before any answer was seen."""
        errors = self.errors
        if not errors or predicted_s <= 0:
            return 0.5
        # realized = predicted / (1 + error): within the limit when 1 + error >= predicted / limit
        needed = predicted_s / limit_s - 1.0
        return sum(1 for error in errors if error >= needed) / len(errors)

    def median_error(self) -> float | None:
        """The median of the recent relative TTFT errors; None before any."""
        if not self.errors:
            return None
        ordered = sorted(self.errors)
        return ordered[len(ordered) // 2]


_UP = math.exp(MEDIAN_STEP)
_DOWN = math.exp(-MEDIAN_STEP)
