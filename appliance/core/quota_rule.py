"""Compute quotas as one rule the lock asks (`lock.Lock`), not functions over its state.

Why it exists: the lock's phases each asked the quota accounts in their own words (`_bill`
billed them, `_drop_spent_quotas` rolled and read them, `next_deadline` worked out the drop
time from them), so what a quota does to a holder was spread over the lock. Here it is one
object with the questions the lock's phases ask of it, and nothing else:

- commands, asked only by the phases of `Lock.schedule` and by a release (`bill`, `spent`,
  `granted`): they bill a holder's time and roll its windows;
- queries, asked by anyone (`drop_at`, and the line's and `terms.LendingRule`'s
  `may_start`, the line's `opens_at`): they look at what was billed, or through a copy of
  the account, and write nothing (`next_deadline`, the line's filing and whether a lender
  is lent to are queries).

The pattern for the other rules (`share.ShareRule`, `priority.PriorityRule`,
`terms.LendingRule`): an object built on the node's state, its commands named for the phase
that asks them, its queries side-effect free. The accounts themselves (windows, debt, the
drain estimate) are `quota.QuotaAccount`.

Cost: each question O(members of the gang asked about) (one account; a window rolled at most
once per window passed).
"""

from __future__ import annotations

from dataclasses import replace

from appliance.core.gang import account
from appliance.core.quota import EPSILON_S, QuotaAccount
from appliance.core.state import Gang, GangPhase, NodeState


class QuotaRule:
    """A gang's compute quota (a lone client's own, else the gang's, `gang.account`)."""

    def __init__(self, state: NodeState) -> None:
        self._s = state

    def of(self, g: Gang) -> QuotaAccount | None:
        return account(self._s, g)

    # ------------------------------------------------------------ commands (the phases)

    def bill(self, g: Gang, now: float) -> None:
        """g's lock time since it was last billed (`g.billed_until`): a holder's in full; a
        draining one's whole drain at its release, at the drop-tail percentage, so that its
        drain estimate learns the drop-to-release time."""
        quota, settings = self.of(g), self._s.policy.scheduler
        if quota is not None and g.phase is GangPhase.DRAINING:
            quota.bill_drain(g.billed_until, now, settings)
        elif quota is not None and g.phase is GangPhase.HOLDING:
            quota.bill(g.billed_until, now, settings)

    def granted(self, g: Gang, now: float) -> None:
        """g was granted: an unused window starts afresh (`QuotaAccount.begin`)."""
        quota = self.of(g)
        if quota is not None:
            quota.begin(now, self._s.policy.scheduler)

    def spent(self, g: Gang, now: float) -> bool:
        """Whether holder g, billed up to now, must drop for its quota: its budget (less its
        drain) is spent, and it has held for at least one sample interval. Rolls its window."""
        quota, settings = self.of(g), self._s.policy.scheduler
        if g.phase is not GangPhase.HOLDING or quota is None:
            return False
        quota.roll(now, settings)
        min_hold = g.granted_at + settings.quota_sample_interval_s
        return quota.hold_s(settings) <= EPSILON_S and now >= min_hold - EPSILON_S

    # ------------------------------------------------------------ queries

    def drop_at(self, g: Gang) -> float | None:
        """When holder g must drop for its quota, as billed so far; None without one. A grant
        lasts at least one sample interval, so a tiny budget cannot turn into grant/drop
        ping-pong; otherwise the drop comes its drain before the budget ends."""
        quota, settings = self.of(g), self._s.policy.scheduler
        if g.phase is not GangPhase.HOLDING or quota is None:
            return None
        left = max(0.0, quota.hold_s(settings))
        return max(g.billed_until + left, g.granted_at + settings.quota_sample_interval_s)

    def may_start(self, g: Gang, now: float) -> bool:
        """Whether g may be granted now: not waiting for its quota's next window."""
        ahead = self._rolled(g, now)
        return ahead is None or ahead.may_start(self._s.policy.scheduler)

    def opens_at(self, g: Gang, now: float) -> float | None:
        """When the window after the current one starts (a waiter its quota keeps out may
        start then); None without a quota."""
        ahead = self._rolled(g, now)
        return None if ahead is None else ahead.next_window(self._s.policy.scheduler)

    def _rolled(self, g: Gang, now: float) -> QuotaAccount | None:
        """A copy of g's account rolled to `now` (asking never writes); None without a quota."""
        quota = self.of(g)
        if quota is None:
            return None
        ahead = replace(quota)
        ahead.roll(now, self._s.policy.scheduler)
        return ahead
