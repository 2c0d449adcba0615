"""Is a GPU fit to take new requests? Judged from NVML's readings (`GpuSample`), with hysteresis.

A replica on a GPU that throttles, logs Xid or uncorrected ECC errors, runs its PCIe link below its
width, or waits for a reset to retire memory still answers `/health`, but it is slow or wrong. The
router soft-drains such a replica (router/fleet/gpus.py); this module only says which GPUs are
degraded and why. Pure: the clock is passed in, so tests step through time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpserve.gpu.sample import GpuSample

# NVML's clocks-event (throttle) reasons, by bit. SW power cap is left out of the default rule: a GPU at
# full load sits at its power cap by design; the others mean heat, a power-supply brake or a board fault.
THROTTLE_BITS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}
DEFAULT_THROTTLE = ("hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")
# Xids an application raises by its own fault or by being killed (13: graphics engine exception, 31: MMU
# fault, 43: channel stopped, 45: preemptive cleanup), not the GPU's: they do not degrade it.
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45)


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for name, bit in THROTTLE_BITS.items() if mask & bit)


def throttle_mask(names: tuple[str, ...]) -> int:
    unknown = [name for name in names if name not in THROTTLE_BITS]
    if unknown:
        raise ValueError(f"unknown throttle reason(s) {', '.join(unknown)}: one of {', '.join(THROTTLE_BITS)}")
    mask = 0
    for name in names:
        mask |= THROTTLE_BITS[name]
    return mask


@dataclass(frozen=True)
class GpuHealthRules:
    """What degrades a GPU, and how long a condition must hold or be gone (documented in the README)."""

    throttle: tuple[str, ...] = DEFAULT_THROTTLE
    """Throttle reasons that degrade it (`THROTTLE_BITS` names)."""
    ignored_xids: tuple[int, ...] = DEFAULT_IGNORED_XIDS
    event_hold_s: float = 300.0
    """A new Xid or uncorrected ECC error keeps the GPU degraded this long after the last one."""
    pcie_busy_utilization: float = 0.5
    """A PCIe generation below the link's maximum counts only while the GPU is at least this busy: idle
    links step down to save power. (A width below the maximum always counts.) Above 1: never."""
    degrade_after_s: float = 2.0
    """A throttle or PCIe condition must last this long before it degrades the GPU (short blips do not)."""
    recover_after_s: float = 30.0
    """Every condition must be gone this long before the GPU takes new requests again."""

    def __post_init__(self) -> None:
        throttle_mask(self.throttle)
        for name in ("event_hold_s", "degrade_after_s", "recover_after_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


def sustained_conditions(gpu: GpuSample, rules: GpuHealthRules) -> list[str]:
    """Conditions that must last `degrade_after_s` (states the GPU is in, read anew each time)."""
    found: list[str] = []
    if gpu.throttle_reasons is not None:
        names = throttle_names(gpu.throttle_reasons & throttle_mask(rules.throttle))
        if names:
            found.append("throttled: " + ", ".join(names))
    if gpu.pcie_width is not None and gpu.pcie_width_max and gpu.pcie_width < gpu.pcie_width_max:
        found.append(f"PCIe link x{gpu.pcie_width} of x{gpu.pcie_width_max}")
    busy = gpu.utilization_gpu is not None and gpu.utilization_gpu >= rules.pcie_busy_utilization
    if busy and gpu.pcie_gen is not None and gpu.pcie_gen_max and gpu.pcie_gen < gpu.pcie_gen_max:
        found.append(f"PCIe link gen{gpu.pcie_gen} of gen{gpu.pcie_gen_max} while busy")
    return found


@dataclass
class _Track:
    xid_errors: int | None = None
    ecc_uncorrected: int | None = None
    event_at: float | None = None
    event_reason: str = ""
    sustained_since: float | None = None
    clear_since: float | None = None
    verdict: GpuVerdict | None = None


@dataclass(frozen=True)
class GpuVerdict:
    degraded: bool = False
    reasons: tuple[str, ...] = ()
    """Why it is degraded (or, while it recovers, why it was)."""
    since: float | None = None
    """When it became degraded."""
    recovering: bool = False
    """Degraded, every condition gone, waiting out `recover_after_s`."""

    def to_dict(self) -> dict[str, Any]:
        reasons = list(self.reasons)
        return {"degraded": self.degraded, "reasons": reasons, "since": self.since, "recovering": self.recovering}


HEALTHY = GpuVerdict()


@dataclass
class GpuHealthTracker:
    """One verdict per GPU (keyed by UUID, unique across hosts), updated with each reading."""

    rules: GpuHealthRules = field(default_factory=GpuHealthRules)
    _tracks: dict[str, _Track] = field(default_factory=dict)

    def update(self, key: str, gpu: GpuSample, now: float) -> GpuVerdict:
        track = self._tracks.setdefault(key, _Track())
        if not gpu.readable:  # a lost GPU: the replica's own probes judge it; keep what was known
            return track.verdict or HEALTHY
        instant = self._events(track, gpu, now)
        sustained = sustained_conditions(gpu, self.rules)
        if not sustained:
            track.sustained_since = None
        elif track.sustained_since is None:
            track.sustained_since = now
        held = track.sustained_since is not None and now - track.sustained_since >= self.rules.degrade_after_s
        reasons = tuple(instant + (sustained if held else []))
        before = track.verdict or HEALTHY
        if reasons:
            track.clear_since = None
            verdict = GpuVerdict(True, reasons, before.since if before.degraded else now)
        elif before.degraded and sustained:  # back before it held again: the clear stretch starts over
            track.clear_since = None
            verdict = GpuVerdict(True, before.reasons, before.since)
        elif before.degraded:
            track.clear_since = now if track.clear_since is None else track.clear_since
            if now - track.clear_since >= self.rules.recover_after_s:
                verdict = HEALTHY
            else:
                verdict = GpuVerdict(True, before.reasons, before.since, recovering=True)
        else:
            verdict = HEALTHY
        track.verdict = verdict
        return verdict

    def _events(self, track: _Track, gpu: GpuSample, now: float) -> list[str]:
        """Xid and uncorrected ECC errors new since the last reading, held `event_hold_s`; memory waiting
        for a reset, for as long as it waits."""
        if gpu.xid_errors is not None:
            new_xid = track.xid_errors is not None and gpu.xid_errors > track.xid_errors
            if new_xid and gpu.last_xid not in self.rules.ignored_xids:
                track.event_at, track.event_reason = now, f"Xid {gpu.last_xid}"
            track.xid_errors = gpu.xid_errors
        if gpu.ecc_uncorrected is not None:
            # The first reading is the baseline: errors from before the router started are not news.
            if track.ecc_uncorrected is not None and gpu.ecc_uncorrected > track.ecc_uncorrected:
                new = gpu.ecc_uncorrected - track.ecc_uncorrected
                track.event_at, track.event_reason = now, f"{new} uncorrected ECC error(s)"
            track.ecc_uncorrected = gpu.ecc_uncorrected
        found: list[str] = []
        if track.event_at is not None and now - track.event_at < self.rules.event_hold_s:
            found.append(track.event_reason)
        if gpu.pages_pending:
            found.append("memory pages pending retirement: the GPU needs a reset")
        return found

    def forget(self, keep: set[str]) -> None:
        """Drop GPUs no longer seen (a host gone from the fleet)."""
        for key in [k for k in self._tracks if k not in keep]:
            del self._tracks[key]
