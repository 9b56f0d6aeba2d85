"""Compute quotas: a client limited to N% of a GPU gets N% of the GPU's time in each window.

Accounting follows the four knobs of nvshare's quota fork, with their meanings there: the
accounting window; the sample interval (the shortest grant, so a tiny budget cannot turn into
grant/drop ping-pong); carry-over (the percentage of what a client used beyond its budget that is
carried into the next window as debt); drop-tail billing (the time from a drop to the client's
release is billed at this percentage).

What the lock holds and what the GPU runs differ by the drain: a client told to drop keeps the
GPU busy until the work it queued has finished, and only then releases. A drop sent when the
budget is spent would overshoot by that drain every window (a compute-bound PyTorch loop drains
for a few milliseconds, a CUDA graph replay for tens). So each account keeps an estimate of its
client's drain (from the drop-to-release time of its recent drops) and the lock drops it that
much before the budget ends: its work then finishes on the budget. A client whose remaining
budget would not even cover its drain waits for its next window.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.policy.model import SchedulerSettings

EPSILON_S = 1e-6  # float slack on quota arithmetic
DRAIN_WEIGHT = 0.25  # how much one drop moves the drain estimate
IDLE_WINDOWS = 10  # windows without use after which debt is forgotten


@dataclass(slots=True)
class QuotaAccount:
    percent: float
    window_start: float
    used_s: float = 0.0  # billed in this window, debt carried in included
    drain_s: float = 0.0  # expected time from a drop to the release
    drains: int = 0  # drops it learnt from
    billed: bool = False  # time of this window was billed (beyond the debt carried into it)

    def window_s(self, settings: SchedulerSettings) -> float:
        return settings.compute_window_s

    def budget_s(self, settings: SchedulerSettings) -> float:
        return self.window_s(settings) * self.percent / 100.0

    def roll(self, now: float, settings: SchedulerSettings) -> None:
        """Start new windows up to `now`; a share of what was used beyond the budget is debt."""
        window = self.window_s(settings)
        while now >= self.window_start + window:
            over = max(0.0, self.used_s - self.budget_s(settings))
            self.used_s = over * self.carried_percent(settings) / 100.0
            self.window_start, self.billed = self.window_start + window, False
            if now >= self.window_start + IDLE_WINDOWS * window:  # long idle: skip ahead
                skipped = int((now - self.window_start) // window)
                self.window_start += skipped * window
                self.used_s = 0.0

    def begin(self, now: float, settings: SchedulerSettings) -> None:
        """A grant: one into a window of which nothing was used starts a window at `now`
        (the debt carried in still owed), so that a loop gets its share from its first step
        whatever the phase it starts at. Otherwise a loop starting late in a window could
        spend a whole budget in what is left of it and then the next window's: up to twice
        its share in its first window's length. Nothing is gained by timing it: the window
        left behind was unused, and windows run on back to back from the new start."""
        self.roll(now, settings)
        if not self.billed:
            self.window_start = now

    def carried_percent(self, settings: SchedulerSettings) -> int:
        """How much of a window's overshoot becomes debt in the next one."""
        return settings.carry_over_percent

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
        """Each part of the span to the window it falls in: time held past a window's end
        counts in the next one, not in one that rolling over would forget."""
        self.roll(start, settings)
        while end > (boundary := self.next_window(settings)):
            self.used_s += (boundary - start) * factor
            start = boundary
            self.roll(start, settings)
        self.used_s += max(0.0, end - start) * factor
        self.billed = self.billed or end > start

    def remaining_s(self, settings: SchedulerSettings) -> float:
        return self.budget_s(settings) - self.used_s

    def hold_s(self, settings: SchedulerSettings) -> float:
        """How much longer a holder may run before its drop, so that its drain ends on the
        budget (never less than nothing)."""
        drain = min(self.drain_s, self.budget_s(settings) / 2)
        return self.remaining_s(settings) - drain

    def may_start(self, settings: SchedulerSettings) -> bool:
        """Whether a grant now would run for any time at all before its drop."""
        return self.hold_s(settings) > EPSILON_S

    def next_window(self, settings: SchedulerSettings) -> float:
        return self.window_start + self.window_s(settings)


@dataclass(slots=True)
class GuaranteeAccount(QuotaAccount):
    """A guaranteed share (`core.share`): its budget is what the client is owed in a window.
    Time used beyond it is burst, GPU time nobody else wanted, so it is never debt. Owed in
    windows of their own (`requestWindow`), longer than a quota's by default."""

    def window_s(self, settings: SchedulerSettings) -> float:
        return settings.request_window_s

    def carried_percent(self, settings: SchedulerSettings) -> int:
        return 0

    def owed_s(self, settings: SchedulerSettings) -> float:
        return max(0.0, self.remaining_s(settings))
