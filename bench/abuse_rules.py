"""The scheduling rules under abuse (issue 24 items 1, 4, 5, 6), measured before and after.

Each attack runs against the core of a checkout on a fake clock (`appliance.core`, events in,
actions out), with clients that behave as the issue's drills did: compute-bound victims that ask
again as soon as they are dropped, a `high` pod that lends its idle GPU and asks again 2 ms
later, a second hook connection on a GPU its process never used, ten connections of one pod.
No sockets and no GPU: the figures are the scheduler's decisions, exactly, not wall time.

- pod: a process whose cgroup names a pod the pod watch has not listed (after a restart, the
  pod's last published limit 40Gi; its uid's rule 1Gi): the limit it gets and whose ledger;
- gang: TQ 2 s, 12.9 s; the victim alone on GPU 1, compute-bound; the attacker's first
  connection is compute-bound on GPU 0, and a further connection of the same process on GPU 1
  (no context there) asks, closes as soon as it has GPU 1, and the next asks 2 ms later: how
  many turns the victim's time on GPU 1 came in, and its longest once the attack began (a
  turn cut every few ms leaves a real program little but drains; instead, beside an honest
  compute-bound client);
- shares: maxCoreRequest 10, ten connections of a pod annotated 10 beside a victim, TQ 2 s,
  15 s: their guaranteed shares together, the victim's share of the GPU;
- starvation: starvation limit 5 s, TQ 2 s, 20.5 s; a `high` client holds until just before
  the victim's limit (as its last request shows it), lends, asks again 2 ms later: how long the
  victim held the GPU, and when it first had a turn of its own (at least 0.1 s).

- churn: a 1 GiB pod (a trusted claim) of two hooked fake-CUDA programs allocating 16-192 MiB
  and freeing in turns, one random script: how many allocations are refused while what both
  hold would leave room (the real daemon and hook of each checkout).

"Before" imports the appliance of another checkout (`--before DIR`: e.g. `git archive ad6fdaa
| tar -x -C DIR`, `make -C DIR/ld_hook build/libnvshare.so build/fake/libcuda.so.1
build/fake/libnvidia-ml.so.1 build/probe`).

    .venv/bin/python bench/abuse_rules.py --before DIR [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
GPU0 = "GPU-00000000-0000-0000-0000-0000000000b0"
GPU1 = "GPU-00000000-0000-0000-0000-0000000000b1"
DRAIN_S = 0.004


class Sim:
    """A core on a fake clock, and clients that answer its actions."""

    def __init__(self, core: Any) -> None:
        from appliance.core import actions as act
        from appliance.core import events as ev

        self.ev = ev
        # What each client is told, and which of its behaviour's answers that calls.
        self._grant = act.Grant
        self._handlers: dict[type, Callable[[Busy, Sim, int, Any], None]] = {
            act.Grant: lambda b, sim, cid, a: b.grant(sim, cid, a),
            act.Drop: lambda b, sim, cid, a: b.drop(sim, cid, a),
            act.GangDrop: lambda b, sim, cid, a: b.gang_drop(sim, cid, a),
            act.GangCut: lambda b, sim, cid, a: b.gang_cut(sim, cid, a),
        }
        self.core = core
        self.now = 1000.0
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._seq = itertools.count(2)
        self.on: dict[int, Any] = {}  # client id -> its behaviour
        self.held: dict[int, float] = {}
        self._since: dict[int, float] = {}
        self.turns: dict[int, list[tuple[float, float]]] = {}
        self._ids = itertools.count(1)

    def register(self, behaviour: Any, *, gpu: str, pid: int, uid: int = 1000, **ident: Any) -> int:
        from appliance.core.identity import ClientIdentity

        cid = next(self._ids)
        who = ClientIdentity(pid=pid, uid=uid, gid=uid, **ident)
        self.feed(self.ev.ClientRegistered(cid, 1, who, gpu, 80 * GiB))
        self.on[cid] = behaviour
        self.held[cid], self.turns[cid] = 0.0, []
        return cid

    def at(self, delay: float, call: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (self.now + delay, next(self._order), call))

    def feed(self, event: Any) -> None:
        for a in self.core.handle(event, self.now):
            handler = self._handlers.get(type(a))
            cid = getattr(a, "client_id", None)
            if handler is None or cid not in self.on:
                continue
            if type(a) is self._grant and cid not in self._since:
                self._since[cid] = self.now
            handler(self.on[cid], self, cid, a)

    def ask(self, cid: int) -> None:
        self.feed(self.ev.LockRequested(cid, next(self._seq)))

    def release(self, cid: int, reason: str) -> None:
        if cid in self._since:
            start = self._since.pop(cid)
            self.held[cid] += self.now - start
            self.turns[cid].append((start, self.now))
        self.feed(self.ev.LockReleased(cid, self.ev.ReleaseReason(reason)))

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while True:
            deadline = self.core.next_deadline()
            timer = self._timers[0][0] if self._timers else None
            nxt = min(t for t in (deadline, timer, end) if t is not None)
            self.now = max(self.now, nxt)
            if nxt >= end:
                break
            if timer is not None and timer <= nxt:
                heapq.heappop(self._timers)[2]()
            else:
                self.feed(self.ev.Tick())
        for cid, start in self._since.items():
            self.held[cid] += end - start
            self.turns[cid].append((start, end))


class Busy:
    """Compute-bound: drops when told (after a drain) and asks again at once."""

    def grant(self, sim: Sim, cid: int, a: Any) -> None:
        pass

    def drop(self, sim: Sim, cid: int, a: Any) -> None:
        sim.at(DRAIN_S, lambda: (sim.release(cid, "dropped"), sim.ask(cid)))

    def gang_drop(self, sim: Sim, cid: int, a: Any) -> None:
        sim.feed(sim.ev.GangPosition(cid, a.cut_id, 0))

    def gang_cut(self, sim: Sim, cid: int, a: Any) -> None:
        self.drop(sim, cid, a)


class Claim(Busy):
    """A further connection of the attacker's process on the victim's GPU: asks for it, and
    closes as soon as it has it (it has nothing to run there); 2 ms later the next one asks."""

    def grant(self, sim: Sim, cid: int, a: Any) -> None:
        def close() -> None:
            sim._since.pop(cid, None)
            sim.feed(sim.ev.ClientGone(cid))
            sim.at(0.002, lambda: claim(sim))

        sim.at(0.001, close)


def claim(sim: Sim) -> None:
    sim.ask(sim.register(Claim(), gpu=GPU1, pid=30, uid=3000))


class Lender(Busy):
    """Holds until just before `victim`'s starvation limit (by its last request), lends the
    GPU idle, asks again 2 ms later."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.victim_asked = 0.0
        self.turn = 0

    def grant(self, sim: Sim, cid: int, a: Any) -> None:
        self.turn += 1
        turn = self.turn
        lend_at = max(sim.now + 0.01, self.victim_asked + self.limit_s - 0.2)

        def lend() -> None:
            if self.turn == turn and cid in sim._since:
                sim.release(cid, "idle")
                sim.at(0.002, lambda: sim.ask(cid))

        sim.at(lend_at - sim.now, lend)


class Victim(Busy):
    def __init__(self, lender: Lender | None = None) -> None:
        self.lender = lender

    def drop(self, sim: Sim, cid: int, a: Any) -> None:
        def again() -> None:
            sim.release(cid, "dropped")
            if self.lender is not None:
                self.lender.victim_asked = sim.now
            sim.ask(cid)

        sim.at(DRAIN_S, again)


def scenario_pod() -> dict[str, Any]:
    from appliance.core import events as ev
    from appliance.core.identity import ClientIdentity
    from appliance.core.node import NodeCore
    from appliance.policy.model import Limits, Policy, Rule, RuleMatch

    rule = Rule(name="per-user", match=RuleMatch(uid=1001), limits=Limits(memory_bytes=GiB))
    pod = "bbbbbbbb-0000-0000-0000-000000000002"
    core = NodeCore(Policy(rules=(rule,)), watching_pods=True, remembered={pod: 40 * GiB})
    who = ClientIdentity(pid=10, uid=1001, gid=1001, pod_uid=pod)
    core.handle(ev.ClientRegistered(1, 1, who, GPU0, 80 * GiB), 1000.0)
    c = core.state.clients[1]
    return {"limit_gib": c.limits.memory_bytes / GiB, "ledger": core.state.subject(c)}


def scenario_gang(honest: bool) -> dict[str, Any]:
    from appliance.core.gpus import GpuFacts
    from appliance.core.node import NodeCore
    from appliance.policy.model import Mode, Policy, SchedulerSettings

    settings = SchedulerSettings(mode=Mode.ON, time_quantum_s=2.0)
    inventory = {u: GpuFacts(uuid=u, memory_total=80 * GiB) for u in (GPU0, GPU1)}
    sim = Sim(NodeCore(Policy(scheduler=settings), inventory=inventory))
    victim = sim.register(Busy(), gpu=GPU1, pid=20, uid=2000)
    sim.ask(victim)
    if honest:
        other = sim.register(Busy(), gpu=GPU1, pid=30, uid=3000)
        sim.ask(other)
    else:
        first = sim.register(Busy(), gpu=GPU0, pid=30, uid=3000)
        sim.ask(first)
        sim.at(0.5, lambda: claim(sim))
    sim.run(12.9)
    return {"victim_held_s": round(sim.held[victim], 3), "victim_turns": len(sim.turns[victim])}


def scenario_shares() -> dict[str, Any]:
    from appliance.core import events as ev
    from appliance.core.annotations import CORE_REQUEST, PodInfo
    from appliance.core.gpus import GpuFacts
    from appliance.core.node import NodeCore
    from appliance.policy.model import AnnotationPolicy, Mode, Policy, SchedulerSettings

    policy = Policy(
        scheduler=SchedulerSettings(mode=Mode.ON, time_quantum_s=2.0),
        annotations=AnnotationPolicy(max_core_request=10),
    )
    inventory = {GPU0: GpuFacts(uuid=GPU0, memory_total=80 * GiB)}
    sim = Sim(NodeCore(policy, inventory=inventory, watching_pods=True))
    greedy = "aaaaaaaa-0000-0000-0000-000000000001"
    sim.feed(ev.PodSeen(PodInfo(greedy, "ml", "greedy", "node-1", {}, {CORE_REQUEST: "10"})))
    pod = [sim.register(Busy(), gpu=GPU0, pid=40, uid=0, pod_uid=greedy) for _ in range(10)]
    victim = sim.register(Busy(), gpu=GPU0, pid=20, uid=2000)
    for cid in [*pod, victim]:
        sim.ask(cid)
    rows = sim.core.status(sim.now).clients
    guaranteed = sum(r.core_guaranteed for r in rows if r.id in pod)
    sim.run(15.0)
    return {
        "pod_guaranteed_percent": round(guaranteed, 1),
        "victim_share_percent": round(100 * sim.held[victim] / 15.0, 1),
        "victim_turns": len(sim.turns[victim]),
    }


def scenario_starvation() -> dict[str, Any]:
    from appliance.core.node import NodeCore
    from appliance.policy.model import Limits, Mode, Policy, Rule, RuleMatch, SchedulerSettings

    limit = 5.0
    settings = SchedulerSettings(mode=Mode.ON, time_quantum_s=2.0, starvation_limit_s=limit)
    high = Rule(name="high", match=RuleMatch(uid=3000), limits=Limits(priority=100))
    sim = Sim(NodeCore(Policy(scheduler=settings, rules=(high,))))
    lender = Lender(limit)
    attacker = sim.register(lender, gpu=GPU0, pid=30, uid=3000)
    victim = sim.register(Victim(lender), gpu=GPU0, pid=20, uid=2000)
    sim.ask(attacker)
    start = lender.victim_asked = sim.now
    sim.ask(victim)
    sim.run(20.5)
    own = [a - start for a, b in sim.turns[victim] if b - a >= 0.1]
    return {
        "victim_held_s": round(sim.held[victim], 3),
        "of_s": 20.5,
        "first_own_turn_s": round(own[0], 2) if own else None,
        "bound_s": limit + settings.time_quantum_s,
    }


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "pod": scenario_pod,
    "gang": lambda: scenario_gang(honest=False),
    "gang_honest": lambda: scenario_gang(honest=True),
    "shares": scenario_shares,
    "starvation": scenario_starvation,
}


def pod_churn(tree: Path, steps: int = 3000, seed: int = 7) -> dict[str, Any]:
    """Two hooked fake-CUDA programs of one 1 GiB pod (a trusted claim, no pod watch) allocate
    and free in turns (the same random script before and after); of the allocations refused,
    how many would have fit beside what both hold. The daemon and hook of `tree`."""
    import random

    from _daemon import BenchDaemon, stop_all

    policy = (
        f"trust: {{podClaimUids: [{os.getuid()}]}}\n"
        "rules:\n- name: pod\n  match: {namespace: team, podName: churn}\n  memoryLimit: 1Gi\n"
    )
    d = BenchDaemon(policy, tree=tree)
    build = tree / "ld_hook" / "build"
    env = {
        **os.environ,
        "NVSHARE_SOCKET_DIR": str(d.socket_dir),
        "LD_PRELOAD": str(build / "libnvshare.so"),
        "LD_LIBRARY_PATH": str(build / "fake"),
        "NVSHARE_FAKE_GPU_UUID": "GPU-bench000-0000-0000-0000-000000000000",
        "NVSHARE_POD_NAMESPACE": "team",
        "NVSHARE_POD_NAME": "churn",
    }
    probes = [
        subprocess.Popen(
            [str(build / "probe"), "run"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]

    def do(pr: subprocess.Popen[str], line: str) -> str:
        assert pr.stdin is not None and pr.stdout is not None
        pr.stdin.write(line + "\n")
        pr.stdin.flush()
        return pr.stdout.readline().strip()

    rng = random.Random(seed)
    held: list[list[tuple[str, int]]] = [[], []]
    refused = with_room = allocs = 0
    try:
        for pr in probes:
            assert do(pr, "init").startswith("ok")
        for _ in range(steps):
            i = rng.randrange(2)
            if held[i] and rng.random() < 0.45:
                handle, size = held[i].pop(rng.randrange(len(held[i])))
                do(probes[i], f"free {handle}")
                continue
            size = rng.choice((16, 32, 64, 128, 192)) << 20
            allocs += 1
            answer = do(probes[i], f"alloc mem {size}")
            if answer.startswith("ok"):
                held[i].append((answer.split()[1], size))
                continue
            refused += 1
            if sum(sz for h in held for _, sz in h) + size <= GiB:
                with_room += 1
    finally:
        stop_all(probes)
        d.stop()
    return {
        "allocations": allocs,
        "refused": refused,
        "refused_with_room_percent": round(100 * with_room / allocs, 1),
    }


def measure(tree: Path) -> dict[str, Any]:
    """Every scenario, against the appliance of `tree`, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, __file__, "--one"], env=env, capture_output=True, text=True, check=True
    )
    return dict(json.loads(out.stdout))


def table(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    rows = [
        "| attack | what | before | after |",
        "|---|---|---:|---:|",
    ]

    def row(attack: str, what: str, key: str, field: str) -> None:
        rows.append(f"| {attack} | {what} | {before[key][field]} | {after[key][field]} |")

    row(
        "cgroup naming an unlisted pod (uid rule 1Gi, pod last published 40Gi)",
        "limit (GiB)",
        "pod",
        "limit_gib",
    )
    row("", "ledger", "pod", "ledger")
    row(
        "gang late join on a GPU never used (TQ 2 s, 12.9 s)",
        "victim's turns (each cut by a drop)",
        "gang",
        "victim_turns",
    )
    row("", "beside an honest client instead: its turns", "gang_honest", "victim_turns")
    row(
        "10 connections of a pod at request 10, cap 10 (TQ 2 s, 15 s)",
        "their guaranteed share (%)",
        "shares",
        "pod_guaranteed_percent",
    )
    row("", "victim's share of the GPU (%)", "shares", "victim_share_percent")
    row(
        "high lends idle, asks again 2 ms later (limit 5 s, TQ 2 s, 20.5 s)",
        "victim held (s)",
        "starvation",
        "victim_held_s",
    )
    row("", "victim's first turn of its own, after (s; bound 7)", "starvation", "first_own_turn_s")
    row(
        "1 GiB pod, two hooked programs allocating and freeing (real daemon and hook)",
        "allocations",
        "churn",
        "allocations",
    )
    row("", "refused while room remained (% of allocations)", "churn", "refused_with_room_percent")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps({name: run() for name, run in SCENARIOS.items()}))
        return
    if args.before is None:
        parser.error("--before DIR is needed (a checkout to compare with)")
    before, after = measure(args.before.resolve()), measure(ROOT)
    before["churn"], after["churn"] = pod_churn(args.before.resolve()), pod_churn(ROOT)
    lines = [
        "## Scheduling rules (fake clock, `bench/abuse_rules.py`)",
        "",
        "- command: `.venv/bin/python bench/abuse_rules.py --before DIR` "
        f"({datetime.date.today()})",
        "",
        *table(before, after),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
