"""Gangs: who takes the GPU lock together, and how a gang of several clients stops.

A job spread over several GPUs (a pod's torchrun ranks, a vLLM tensor-parallel group, one
process driving two GPUs) is only useful when all of its GPUs run at once: with one lock per
GPU taken one at a time, rank 0 can hold GPU 0 while rank 1 waits behind another job on GPU 1,
and rank 0's all-reduce then stalls until a quantum runs out. So the lock is granted to gangs,
all of a gang's GPUs at once or none (`lock`).

Who is one gang (the key):
- the processes of one pod, by the pod UID the kernel shows in their cgroup, once the pod watch
  knows that pod;
- where the cgroup shows no pod: the processes of one user that name the same job, by
  `NVSHARE_GANG` or else torch.distributed's rendezvous (`TORCHELASTIC_RUN_ID`, `MASTER_ADDR`,
  `MASTER_PORT`, which torchrun, `mp.spawn` scripts and launchers built on them set for every
  rank); the hook sends that name, and it only ever groups a user's own processes;
- otherwise one process.
Not the process group or session: two unrelated jobs started from one script share those.
Clients of one key become a gang only once they have asked for the locks of two or more GPUs;
until then each client is its own gang (one member, one GPU), exactly the per-process lock of
single-GPU sharing, so single-GPU clients keep their behaviour. A gang takes the GPUs its
members asked for during its last turn (a GPU touched once and then left alone drops out).

Stopping a gang of several clients: a drop closes every member's gate, but members that are
collectives apart (rank 0 queued all-reduce n, rank 1 was stopped before it) would then wait on
each other forever while draining. The hooks count the collectives they submit (NCCL's kernels,
launched in the remote memory-synchronisation domain). A drop asks every member where it
stands (and holds its next collective), the cut is the furthest of them, and every member runs
up to the cut before it releases: one behind the cut asks for its GPU back to get there.

`GangRule` is the one object the lock (`lock.Lock`) asks about gangs, as it asks
`quota_rule.QuotaRule` about quotas:
- commands, named for the event or phase that asks them: `registered`, `asked`, `left`,
  `refresh` (membership; NodeCore's limits refresh asks `refresh`), `turn_over` (a release),
  `begin_cut` (a drop), `force_cut` (passing over a late member), `cut_over` (the release
  after a cut), `position` (a member's answer). They write gangs and their cuts.
- queries, asked by the grant and preempt phases and by `next_deadline`: `grantable`,
  `in_the_way`, `behind`. They write nothing.
Cost, in clients touched: `asked` 1 (a gang's first forming looks at the job's clients once:
O(n)); `left`, `refresh`, the cuts: the gang's members; `grantable`: the GPU's holders and the
gang's members (in mode `auto`; else none); `in_the_way`: the members of the gangs that hold
only part of their GPUs (none in the usual case); `behind` none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.priority import PriorityRule
from appliance.core.quota import QuotaAccount
from appliance.core.state import Client, Cut, Gang, GangPhase, NodeState, Phase
from appliance.policy.model import Mode


def gang_key(s: NodeState, c: Client) -> str:
    """The job a client belongs to, by the rules above: its pod only once the pod watch knows
    it (a cgroup named like a pod proves nothing before), and fixed once it asked (`job`)."""
    if c.job:
        return c.job
    if s.pod_of(c.ident)[1] == "cgroup":
        return f"pod:{c.ident.pod_uid}"
    if c.gang_hint:
        return f"uid:{c.ident.uid}:{c.gang_hint}"
    return f"pid:{c.ident.pid}"


def lone_key(client_id: int) -> str:
    return f"client:{client_id}"


def account(s: NodeState, g: Gang) -> QuotaAccount | None:
    """The quota account a gang's time is billed to: a lone client's own, else the gang's."""
    if len(g.members) != 1:
        return g.quota
    (member,) = g.members
    return s.clients[member].quota


def gang_of(s: NodeState, c: Client) -> Gang:
    return s.gangs[c.gang]


def label(g: Gang) -> str:
    """How status names a gang of several clients; "" for a lone client."""
    return g.key if g.joint else ""


class GangRule:
    """Membership, cuts, and what the lock asks of gangs; the lock (`lock.Lock`) decides when
    gangs hold and drop (the module's docstring)."""

    def __init__(
        self,
        state: NodeState,
        *,
        priorities: PriorityRule,
        refile: Callable[[Gang], None],
        forget: Callable[[str], None],
    ) -> None:
        self._s = state
        self._priorities = priorities  # who borrowed a gang's idle GPU
        self._refile = refile  # `line.Line`: a gang changed what it is filed by
        self._forget = forget

    # ------------------------------------------------------------ membership

    def registered(self, c: Client) -> None:
        c.gang = lone_key(c.id)
        self._s.gangs[c.gang] = Gang(key=c.gang, members={c.id}, gpus={c.gpu})
        self.refresh(self._s.gangs[c.gang])

    def joined(self, c: Client) -> None:
        """c asked for the lock for the first time: its job's key counts it (`left`)."""
        if not c.asked:
            c.asked = True
            c.job = gang_key(self._s, c)
            self._s.askers[c.job] += 1

    def hinted(self, e: ev.GangHint, now: float) -> list[act.Action]:
        c = self._s.clients.get(e.client_id)
        if c is not None and not c.asked:  # a key never changes once the client is in line
            c.gang_hint = e.name
        return []

    def reported(self, e: ev.GangPosition, now: float) -> list[act.Action]:
        c = self._s.clients.get(e.client_id)
        return [] if c is None else self.position(c, e.cut_id, e.collectives)

    def asked(self, c: Client, now: float) -> list[act.Action]:
        """c asks for its GPU's lock: it may join its job's gang, or make it one."""
        self.joined(c)
        key = c.job
        if c.gang == key:
            return []
        if key in self._s.gangs:
            self._join(self._s.gangs[key], c)
            return []
        asked = self._s.gang_gpus.setdefault(key, set())
        asked.add(c.gpu)
        if len(asked) < 2:
            return []
        return self._form(key, now)

    def _join(self, g: Gang, c: Client) -> None:
        """A client of the gang's job asks for the first time: a member from now on."""
        del self._s.gangs[c.gang]  # its own gang never held anything: it had not asked
        self._forget(c.gang)
        c.gang = g.key
        g.members.add(c.id)
        self.refresh(g)

    def _form(self, key: str, now: float) -> list[act.Action]:
        """The job's clients asked for two GPUs: their lone gangs become one, which keeps
        what they hold and their place in line."""
        s = self._s
        lone = [s.gangs[c.gang] for c in s.clients.values() if c.asked and c.job == key]
        g = Gang(key=key)
        for old in lone:
            g.members |= old.members
            g.gpus |= old.gpus
            g.held |= old.held
            g.asked |= old.asked
            for uuid in old.held:
                s.gpus[uuid].owners.discard(old.key)
                s.gpus[uuid].owners.add(key)
            del s.gangs[old.key]
            self._forget(old.key)
        for m in g.members:
            s.clients[m].gang = key
        s.gangs[key] = g
        s.gang_gpus.pop(key, None)
        self.refresh(g)
        out = self._merge_turns(g, lone, now)
        self._refile(g)
        return out

    def _merge_turns(self, g: Gang, lone: list[Gang], now: float) -> list[act.Action]:
        """The gang's phase from its parts: holding if a part held; all of it drops if a part
        was already dropping; else waiting at the earliest place in line of its parts."""
        holding = [o for o in lone if o.phase in (GangPhase.HOLDING, GangPhase.DRAINING)]
        waiting = [o for o in lone if o.phase is GangPhase.WAITING]
        g.offender = any(o.offender for o in lone)
        if not holding:
            if waiting:
                first = min(waiting, key=lambda o: o.ticket)
                g.phase, g.ticket, g.requested_at = (
                    GangPhase.WAITING,
                    first.ticket,
                    first.requested_at,
                )
                g.waiting_since = first.waiting_since
            return []
        g.granted_at = min(o.granted_at for o in holding)
        g.quantum_from = min(o.quantum_from for o in holding)
        g.billed_until = now
        draining = [o for o in holding if o.phase is GangPhase.DRAINING]
        if not draining:
            g.phase = GangPhase.HOLDING
            return []
        g.phase, g.dropped_at = GangPhase.DRAINING, min(o.dropped_at for o in draining)
        for m in g.members:  # all or nothing: the parts still holding drop too
            c = self._s.clients[m]
            if c.phase is Phase.HOLDING:
                c.phase, c.dropped_at = Phase.DRAINING, now
        # The part told to drop alone may sit in a collective that waits for the new member:
        # the cut lets that member catch up to it.
        return self.begin_cut(g)

    def refresh(self, g: Gang) -> None:
        """A gang's priority is its members' highest; a gang of several clients has one quota
        account, at its members' lowest core limit."""
        g.priority = max(self._s.clients[m].limits.priority for m in g.members)
        if not g.joint:
            g.quota = None
            self._refile(g)
            return
        percent = min(self._s.clients[m].limits.core_percent for m in g.members)
        if percent >= 100:
            g.quota = None
        elif g.quota is None:
            g.quota = QuotaAccount(percent=percent, window_start=g.billed_until)
        else:
            g.quota.percent = percent
        self._refile(g)

    def left(self, c: Client) -> list[act.Action]:
        """c is gone: out of its gang (whose GPU it alone used is freed), and out of a cut."""
        s = self._s
        g = s.gangs[c.gang]
        g.members.discard(c.id)
        if not g.members:
            for uuid in g.held:
                s.gpus[uuid].owners.discard(g.key)
            del s.gangs[g.key]
            self._forget(g.key)
        elif not any(s.clients[m].gpu == c.gpu for m in g.members):
            g.gpus.discard(c.gpu)
            g.asked.discard(c.gpu)
            if c.gpu in g.held:
                g.held.discard(c.gpu)
                s.gpus[c.gpu].owners.discard(g.key)
        if g.members:
            self.refresh(g)
        key = c.job
        if c.asked:
            s.askers[key] -= 1
            if not s.askers[key]:
                del s.askers[key]
                s.gang_gpus.pop(key, None)
        if g.cut is None or c.id not in g.cut.expected:
            return []
        g.cut.expected.discard(c.id)
        g.cut.positions.pop(c.id, None)
        return self._maybe_cut(g)

    def turn_over(self, g: Gang) -> None:
        """A turn ended: the gang keeps the GPUs its members asked for during it, and those
        its waiting members want."""
        kept = set(g.asked)
        for m in g.members:  # (a loop: once a turn)
            c = self._s.clients[m]
            if c.phase is Phase.WAITING:
                kept.add(c.gpu)
        if kept:
            g.gpus = kept
        g.asked = set()

    # ------------------------------------------------------------ the cut

    def begin_cut(self, g: Gang) -> list[act.Action]:
        """Ask every gated member where its collectives stand; their hooks hold the next one."""
        self._s.cuts += 1
        members = {m for m in g.members if self._s.clients[m].gated}
        g.cut = Cut(id=self._s.cuts, expected=members)
        return [act.GangDrop(m, g.cut.id) for m in sorted(members)]

    def position(self, c: Client, cut_id: int, collectives: int) -> list[act.Action]:
        g = self._s.gangs[c.gang]
        if g.cut is None or g.cut.id != cut_id or c.id not in g.cut.expected:
            return []
        g.cut.positions[c.id] = collectives
        return self._maybe_cut(g)

    def _maybe_cut(self, g: Gang, *, force: bool = False) -> list[act.Action]:
        cut = g.cut
        if cut is None or cut.collectives is not None:
            return []
        if not force and not cut.expected <= cut.positions.keys():
            return []
        cut.collectives = max(cut.positions.values(), default=0)
        return [act.GangCut(m, cut.id, cut.collectives) for m in sorted(cut.expected)]

    def force_cut(self, g: Gang) -> list[act.Action]:
        """The drop deadline passed before every member answered: cut where the others are."""
        return self._maybe_cut(g, force=True)

    def cut_over(self, g: Gang) -> list[act.Action]:
        """Every member has released: collectives run freely again."""
        cut, g.cut = g.cut, None
        if cut is None:
            return []
        return [act.GangCutOver(m, cut.id) for m in sorted(cut.expected) if m in g.members]

    # ------------------------------------------------------------ queries (grant, preempt)

    def held_back(self, g: Gang, blocked: set[str]) -> bool:
        """Whether one of g's GPUs is `blocked` (kept for a gang ahead in line) or cannot be
        granted to g now (`grantable`). (A loop: a generator costs more than a lone GPU's
        check, and this is asked of every gang the grant phase reads.)"""
        for uuid in g.gpus:
            if uuid in blocked or not self.grantable(uuid, g):
                return True
        return False

    def grantable(self, uuid: str, g: Gang) -> bool:
        """Whether GPU `uuid` can be granted to g now, by its mode: in `off` always, in `on` when no
        other gang holds it but one that borrowed g's idle time and is draining it (its queued work
        finishes beside g's), in `auto` while g's members there fit beside its holders."""
        s = self._s
        owners = s.gpus[uuid].owners
        if not owners or (len(owners) == 1 and g.key in owners):
            return True  # (the usual case, asked for every gang the grant phase reads)
        mode = s.gpu_mode(uuid)
        if mode is Mode.OFF:
            return True
        if mode is Mode.ON:
            for k in owners:  # (a loop: asked on every request while another gang holds)
                o = s.gangs[k]
                if k != g.key and not (
                    o.phase is GangPhase.DRAINING and self._priorities.borrowed(o, g)
                ):
                    return False  # (in mode on nothing else can make it grantable)
            return True
        if mode is not Mode.AUTO or not (size := s.gpu_memory(uuid)):
            return False  # nothing is known to fit on a GPU of unknown size: serialise
        running = sum(s.clients[h].footprint for h in s.gpus[uuid].holders)
        joining = sum(s.clients[m].footprint for m in g.members if s.clients[m].gpu == uuid)
        return running + joining <= size - s.policy.memory.reserve_bytes

    def in_the_way(self, owning: Iterable[Gang], now: float) -> tuple[list[Gang], float | None]:
        """Holding gangs that must drop now, not at the end of their quantum: they own a GPU that a
        gang holding only part of its GPUs (a member joined late, or asked for one more) waits for,
        and NVML shows that member's process on that GPU (`touched`). That gang's members already
        run and may sit in a collective waiting for the member that waits, so every second of
        quantum left would idle both. Of two such gangs waiting for each other, only the younger
        drops. A member NVML does not show there (no NVML, a sample not yet taken, or no context at
        all) has the holder drop at the end of its quantum instead, as any waiter would. Returns
        those due now, and when the next one is due."""
        s = self._s
        growing = []
        for g in owning:  # (a loop, no list made: asked twice an event, and nobody grows)
            if g.phase is GangPhase.HOLDING and len(g.gpus) > len(g.held):
                growing.append(g)
        if not growing:
            return [], None  # (the usual case: every holder holds all it takes)
        growing.sort(key=lambda g: (g.granted_at, g.ticket))
        out: dict[str, Gang] = {}
        later: float | None = None
        for i, g in enumerate(growing):
            older = {o.key for o in growing[:i]}
            for uuid in g.gpus - g.held:
                shown = any(touched(s.clients[m]) for m in g.members if s.clients[m].gpu == uuid)
                for key in s.gpus[uuid].owners - older - {g.key}:
                    o = s.gangs[key]
                    if o.phase is not GangPhase.HOLDING:
                        continue
                    at = now if shown else o.quantum_from + quantum(s, o)
                    if at <= now:
                        out[key] = o
                    elif later is None or at < later:
                        later = at
        return list(out.values()), later

    def behind(self, g: Gang, c: Client) -> bool:
        """A member asking to reach the cut may have its GPU while the gang stops: back, or,
        when the gang dropped before it had that GPU, beside its holder (the one way out of a
        collective that the rest of the gang has already begun)."""
        return g.phase is GangPhase.DRAINING and g.cut is not None


def touched(c: Client) -> bool:
    """Whether NVML has shown c's process on c's GPU: it has a context there. A hook
    connection is only a claim; a second connection of a process on a GPU it never used (any
    GPU of the node) must not take that GPU from its holder at once."""
    return c.nvml_used is not None


def quantum(s: NodeState, g: Gang) -> float:
    """A gang's quantum: the shortest of its GPUs'. (The node's, looked up for no GPU, is
    worked out afresh each time: asked only of a gang that holds none.)"""
    return min(map(s.time_quantum, g.held)) if g.held else s.time_quantum("")
