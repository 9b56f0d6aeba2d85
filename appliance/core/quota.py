"""Compute quotas: a client limited to N% of a GPU gets N% of the GPU's time, measured over
any span, not only over whole windows.

A quota is a bucket of GPU time (`QuotaAccount`): it fills at N% of wall time, up to N% of one
`computeWindow`; holding the lock empties it; what a client holds beyond it is debt (the part
`carryOverPercent` says), paid back before it is granted again. A client is granted once its
allowance covers its drain and one `quotaSampleInterval` (the shortest grant, so a small budget
cannot turn into grant/drop ping-pong), and dropped when what is left covers only its drain. So a
client that always wants the GPU holds it for about one sample interval at a time, and over any
span T it gets N% of T within about (sample interval + drain) / T: 50 ms in a 1 s span is 5
points, in an 8 s span 0.6. A new client's bucket starts empty: no burst of a whole window's
budget at start (the window model before held only over whole windows, and a user's 8 s
measurement found 57 % under a 50 % limit). A client idle for a while may then run up to one
window's budget at once.

What the lock holds and what the GPU runs differ by the drain: a client told to drop keeps the
GPU busy until the work it queued has finished, and only then releases. A drop sent when the
allowance is spent would overshoot by that drain every time (a compute-bound PyTorch loop drains
for a few milliseconds, a CUDA graph replay for tens). So each account keeps an estimate of its
client's drain (from the drop-to-release time of its recent drops) and the lock drops it that
much before the allowance ends: its work then finishes on it. The time from the drop to the
release is billed at `dropTailBillingPercent`.

Guaranteed shares (`GuaranteeAccount`, `core.share`) keep whole windows: what a client is owed
in the current window.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.policy.model import SchedulerSettings

EPSILON_S = 1e-6  # float slack on quota arithmetic
DRAIN_WEIGHT = 0.25  # how much one drop moves the drain estimate


@dataclass(slots=True)
class QuotaAccount:
    percent: float
    at: float  # the allowance is brought up to this time
    allowance_s: float = 0.0  # GPU time it may still hold; below zero, debt
    drain_s: float = 0.0  # expected time from a drop to the release
    drains: int = 0  # drops it learnt from

    def budget_s(self, settings: SchedulerSettings) -> float:
        """The most the bucket holds: the limit's share of one compute window."""
        return settings.compute_window_s * self.percent / 100.0

    def used_s(self, settings: SchedulerSettings) -> float:
        """How much of a full bucket is spent (debt included), as status shows it."""
        return self.budget_s(settings) - self.allowance_s

    def roll(self, now: float, settings: SchedulerSettings) -> None:
        """Fill the bucket for the time since it was last brought up to date (not holding)."""
        if now > self.at:
            filled = self.allowance_s + (now - self.at) * self.percent / 100.0
            self.allowance_s = min(self.budget_s(settings), filled)
            self.at = now

    def bill(self, start: float, end: float, settings: SchedulerSettings) -> None:
        """The client held the lock from `start` to `end` before it was told to drop."""
        self._bill_span(start, end, 1.0, settings)

    def bill_drain(self, start: float, end: float, settings: SchedulerSettings) -> None:
        """From a drop (`start`) to the release (`end`): billed at the drop-tail percentage,
        and the client's drain estimate learns from it."""
        self._bill_span(start, end, settings.drop_tail_billing_percent / 100.0, settings)
        weight = DRAIN_WEIGHT if self.drains else 1.0  # the first drain is all it knows
        self.drain_s += weight * (max(0.0, end - start) - self.drain_s)
        self.drains += 1

    def _bill_span(
        self, start: float, end: float, factor: float, settings: SchedulerSettings
    ) -> None:
        """While it holds, the bucket fills as ever and empties at the rate of the GPU's time
        (`factor` of it); only `carryOverPercent` of new debt is kept."""
        self.roll(start, settings)
        span = max(0.0, end - max(start, self.at))
        before = self.allowance_s
        self.allowance_s += span * (self.percent / 100.0 - factor)
        new_debt = max(0.0, -self.allowance_s) - max(0.0, -before)
        self.allowance_s += new_debt * (1.0 - settings.carry_over_percent / 100.0)
        self.at = max(self.at, end)

    def _drain(self, settings: SchedulerSettings) -> float:
        """What the drain takes from the bucket (which fills meanwhile), at most half of it."""
        net = self.drain_s * (1.0 - self.percent / 100.0)
        return min(net, self.budget_s(settings) / 2)

    def hold_s(self, settings: SchedulerSettings) -> float:
        """How much longer a holder may run before its drop, so that its drain ends on the
        allowance (never less than nothing)."""
        return self.allowance_s - self._drain(settings)

    def _start_at_s(self, settings: SchedulerSettings) -> float:
        """The allowance a grant waits for: its drain and one sample interval, or a full
        bucket where the budget is smaller than that."""
        wanted = self._drain(settings) + settings.quota_sample_interval_s
        return min(self.budget_s(settings), wanted)

    def may_start(self, settings: SchedulerSettings) -> bool:
        """Whether a grant now would run at least its sample interval before its drop."""
        return self.allowance_s >= self._start_at_s(settings) - EPSILON_S

    def ready_at(self, settings: SchedulerSettings) -> float:
        """When the bucket, not holding, will have filled enough for a grant."""
        short = max(0.0, self._start_at_s(settings) - self.allowance_s)
        return self.at + short / max(self.percent / 100.0, EPSILON_S)


@dataclass(slots=True)
class GuaranteeAccount:
    """A guaranteed share (`core.share`): the client is owed its percent of each window. Time
    used beyond it is burst, GPU time nobody else wanted, so it is never debt."""

    percent: float
    window_start: float
    used_s: float = 0.0  # billed in this window

    def budget_s(self, settings: SchedulerSettings) -> float:
        return settings.compute_window_s * self.percent / 100.0

    def roll(self, now: float, settings: SchedulerSettings) -> None:
        """Start new windows up to `now`, each owed afresh."""
        window = settings.compute_window_s
        if now >= self.window_start + window:
            self.window_start += ((now - self.window_start) // window) * window
            self.used_s = 0.0

    def bill(self, start: float, end: float, settings: SchedulerSettings) -> None:
        """The client held the lock from `start` to `end`: each part of the span in the window
        it falls in."""
        self.roll(start, settings)
        while end > (boundary := self.next_window(settings)):
            self.used_s += boundary - start
            start = boundary
            self.roll(start, settings)
        self.used_s += max(0.0, end - start)

    def owed_s(self, settings: SchedulerSettings) -> float:
        return max(0.0, self.budget_s(settings) - self.used_s)

    def next_window(self, settings: SchedulerSettings) -> float:
        return self.window_start + settings.compute_window_s
