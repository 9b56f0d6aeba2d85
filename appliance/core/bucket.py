"""A bucket of the lock's line (`line.Line`): the waiting gangs of one class (offender, owed
its share, priority) in ticket order, and those of them that lent their GPU, filed twice: by when
they lent (whether a holder borrowed from a higher priority: any lender will do, the earliest is
read) and by how far into their quantum they asked again (whether an equal takes its GPU back:
if the one that asked soonest does not, none does; a lender that lent long ago and asked after
its quantum must not hide one that does). Every question O(1); filing O(log n)."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterator
from typing import NamedTuple

from appliance.core.state import Gang

Class = tuple[bool, bool, int]  # a bucket's: offender, owed, priority


class Filing(NamedTuple):
    """What a waiting gang was filed by (what `Line._unfile` must find it by again). (A tuple: one
    is made for every gang that starts waiting, and a frozen dataclass costs a call a field.)"""

    ticket: int
    priority: int
    offender: bool
    gpus: tuple[str, ...]
    lent_at: float | None
    asked_into: float  # how far into its quantum it asked (`PriorityRule.takes_back`), if it lent
    eligible: bool  # its quota lets it start (`QuotaRule.may_start`)
    owed: bool  # part of a member's share is owed to it (`share`)

    @property
    def cls(self) -> Class:
        return (self.offender, self.owed, self.priority)


class Bucket:
    """Waiting gangs of one class, in ticket order; and those of them that lent their GPU,
    by when they lent and by how far into their quantum they asked again."""

    __slots__ = ("back", "gangs", "lent", "order")

    def __init__(self) -> None:
        self.order: list[tuple[int, str]] = []  # (ticket, key), sorted
        self.gangs: dict[str, Gang] = {}
        self.lent: list[tuple[float, int, str]] = []  # (lent_at, ticket, key), sorted
        self.back: list[tuple[float, int, str]] = []  # (asked_into, ticket, key), sorted

    def __len__(self) -> int:
        return len(self.order)

    def add(self, g: Gang, f: Filing) -> None:
        insort(self.order, (f.ticket, g.key))
        self.gangs[g.key] = g
        if f.lent_at is not None:
            insort(self.lent, (f.lent_at, f.ticket, g.key))
            insort(self.back, (f.asked_into, f.ticket, g.key))

    def remove(self, key: str, f: Filing) -> None:
        del self.order[bisect_left(self.order, (f.ticket, key))]
        del self.gangs[key]
        if f.lent_at is not None:
            del self.lent[bisect_left(self.lent, (f.lent_at, f.ticket, key))]
            del self.back[bisect_left(self.back, (f.asked_into, f.ticket, key))]

    def first(self) -> Gang:
        return self.gangs[self.order[0][1]]

    def first_lender(self, before: float) -> Gang | None:
        """The gang that lent its GPU earliest, if that was at or before `before`."""
        if self.lent and self.lent[0][0] <= before:
            return self.gangs[self.lent[0][2]]
        return None

    def soonest_back(self, before: float) -> Gang | None:
        """The lender that asked again soonest into its own quantum, if it lent at or before
        `before`: if it does not take its GPU back (`PriorityRule.takes_back`), none does."""
        g = self.gangs[self.back[0][2]] if self.back else None
        return g if g is not None and g.lent_at is not None and g.lent_at <= before else None

    def walk(
        self, starved: Callable[[Gang], bool], want: bool, skip: Gang | None
    ) -> Iterator[Gang]:
        """In ticket order, the gangs whose starvation is `want` (a prefix, or the rest), but
        `skip` (given out already). The reader may take the one just given out (a grant)."""
        i = 0
        while i < len(self.order):
            entry = self.order[i]
            g = self.gangs[entry[1]]
            if starved(g) != want or g is skip:
                if want:
                    return  # past the starved prefix
                i += 1
                continue
            yield g
            if i < len(self.order) and self.order[i] == entry:
                i += 1


def bucket_of(buckets: dict[Class, Bucket], cls: Class) -> Bucket:
    """The bucket of class `cls`, made when it is the first (a `setdefault` would make one
    for every gang filed)."""
    bucket = buckets.get(cls)
    if bucket is None:
        bucket = buckets[cls] = Bucket()
    return bucket


def remove_from(buckets: dict[Class, Bucket], cls: Class, key: str, f: Filing) -> None:
    bucket = buckets[cls]
    bucket.remove(key, f)
    if not bucket:
        del buckets[cls]
