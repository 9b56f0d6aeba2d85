"""Why a holder is told to drop the lock: one list, owned here.

The lock decides (`lock`, `yielding`, `priority`, `share`, `ahead`), `state.LockUsage` counts
them per client, and status, `nvsharectl top`, the metrics and the log show them by name.
"""

from __future__ import annotations

import enum


class DropReason(enum.StrEnum):
    """Why a holder was told to drop: the one list the lock, status, metrics and logs use.

    A `StrEnum`, so a reason is its wire name wherever it is shown (a status document's key,
    a metric's label, `drops_<reason>` in the counters) and nothing converts it by hand.
    """

    QUANTUM = "quantum"  # its time quantum ran out while someone waited
    QUOTA = "quota"  # its compute quota for the window is spent
    PRIORITY = "priority"  # a higher priority took the GPU after a slice
    REQUEST = "request"  # a waiter is owed its guaranteed share
    GANG = "gang"  # in the way of a gang that holds part of its GPUs
    RECLAIM = "reclaim"  # a borrower dropped ahead of its lender's next request (`ahead`)
    LENT = "lent"  # an equal took back the GPU it lent inside its quantum (`lent_back`)
