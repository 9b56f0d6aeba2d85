"""Compute quotas: a client limited to N% of a GPU may hold its lock for N% of each window.

Accounting follows the four knobs of nvshare's quota fork: the accounting window, the sample
interval (the finest step a quota deadline is scheduled at), carry-over (unused share of one
window, up to a percentage of the window, is added to the next) and drop-tail billing (the
time a client spends draining its work after being told to drop is billed at a percentage,
since the GPU is still partly busy with it).
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.policy.model import SchedulerSettings


@dataclass(slots=True)
class QuotaAccount:
    percent: int
    window_start: float
    used_s: float = 0.0
    carry_s: float = 0.0

    def budget_s(self, settings: SchedulerSettings) -> float:
        return settings.compute_window_s * self.percent / 100.0 + self.carry_s

    def roll(self, now: float, settings: SchedulerSettings) -> None:
        """Start new windows up to `now`, carrying unused budget over."""
        window = settings.compute_window_s
        while now >= self.window_start + window:
            unused = max(0.0, self.budget_s(settings) - self.used_s)
            self.carry_s = min(unused, window * settings.carry_over_percent / 100.0)
            self.used_s = 0.0
            self.window_start += window
            if now >= self.window_start + 10 * window:  # long idle: skip ahead
                skipped = int((now - self.window_start) // window)
                self.window_start += skipped * window
                self.carry_s = 0.0

    def bill(self, seconds: float, *, tail: bool, settings: SchedulerSettings) -> None:
        factor = settings.drop_tail_billing_percent / 100.0 if tail else 1.0
        self.used_s += max(0.0, seconds) * factor

    def remaining_s(self, settings: SchedulerSettings) -> float:
        return self.budget_s(settings) - self.used_s

    def next_window(self, settings: SchedulerSettings) -> float:
        return self.window_start + settings.compute_window_s
