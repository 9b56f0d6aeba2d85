"""Priorities and guaranteed-plus-burst compute on a real GPU, under the hook and the daemon.

(a) An inference loop (a small request every 50 ms: four 1024-wide fp16 layers on a batch of
    32, then a synchronise; its latency from submission to the synchronise's return) at priority
    high beside a compute-bound training loop at priority low (a 4-layer 4096-wide bf16 MLP,
    forward, backward and SGD step, `loss.item()` every step), mode `on` with TQ 5 s and the
    default preemptAfter, starvationLimit, idleHandoff and reclaimAhead; the same with
    reclaimAhead 0 (`on_no_ahead`); the same pair in mode `off`; each loop alone. Reports the
    inference p50/p99 against alone, the trainer's steps/s against solo, and how often the lock
    moved (the daemon's counters).
(b) Two copies of the training loop with coreRequest 30 and 70 (both capped at 100): the
    trainer alone, the one with 30 alone, then both together; each one's share is its steps/s
    over the solo rate (the mean of the two alone runs).
Each part runs `--repeat` times; ratios are against the same repetition's alone runs, and the
medians are reported beside every repetition (the GPU machines are shared and noisy).

Every worker is this script run by its own hard link of the Python interpreter, so policy rules
tell them apart by executable (`*-nvs-infer`, ...) as they would tell programs apart on a
workstation; all workers start together (a barrier) and measure for the same seconds.

    python3 bench/priorities.py [--seconds 12] [--share-seconds 24] [--repeat 3] [--json OUT]
    (needs PyTorch and a GPU; the 30/70 pair runs whole multiples of two compute windows)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _daemon import BenchDaemon, machine

from appliance.wire.protocol import StatusRequest

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "ld_hook" / "build" / "libnvshare.so"
PERIOD_S = 0.05
RULES = """
rules:
  - {name: inference, match: {executable: '*-nvs-infer'}, priority: high}
  - {name: training, match: {executable: '*-nvs-train'}, priority: low}
  - {name: request-30, match: {executable: '*-nvs-r30'}, coreRequest: 30}
  - {name: request-70, match: {executable: '*-nvs-r70'}, coreRequest: 70}
"""


# ------------------------------------------------------------------ workers (under the hook)


def _barrier(ready: Path) -> None:
    ready.touch()
    go = ready.parent / "go"
    while not go.exists():
        time.sleep(0.005)


def infer(seconds: float, out: Path, ready: Path) -> None:
    import torch

    layers = [torch.randn(1024, 1024, device="cuda", dtype=torch.float16) / 32 for _ in range(4)]
    x = torch.randn(32, 1024, device="cuda", dtype=torch.float16)

    def request() -> float:
        t0 = time.perf_counter()
        y = x
        for w in layers:
            y = torch.relu(y @ w)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(20):
        request()
    _barrier(ready)
    latencies = []
    start = next_at = time.perf_counter()
    while next_at < start + seconds:
        latencies.append(request())
        next_at += PERIOD_S
        time.sleep(max(0.0, next_at - time.perf_counter()))
    out.write_text(json.dumps({"latencies_s": latencies}))


def train(seconds: float, out: Path, ready: Path) -> None:
    import torch

    layers = [torch.nn.Linear(4096, 4096) for _ in range(4)]
    model = torch.nn.Sequential(*layers).to("cuda", torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    for _ in range(10):
        step()
    _barrier(ready)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() < start + seconds:
        step()
        steps += 1
    out.write_text(json.dumps({"steps": steps, "seconds": time.perf_counter() - start}))


# ------------------------------------------------------------------ the bench


def interpreter(role: str) -> str:
    """The interpreter under a name for the role, next to it (so it finds the same prefix): a
    hard link, or a copy where links cannot be made."""
    real = os.path.realpath(sys.executable)
    named = f"{real}-nvs-{role}"
    if not os.path.exists(named):
        try:
            os.link(real, named)
        except OSError:
            shutil.copy2(real, named)
    return named


def run(policy: str | None, roles: list[str], seconds: float) -> dict[str, Any]:
    """Run one worker per role together (under the hook and a daemon with `policy`, or alone
    without either when policy is None); each worker's result by role."""
    daemon = BenchDaemon(policy + RULES) if policy is not None else None
    tmp = Path(tempfile.mkdtemp(prefix="nvs-prio-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    if daemon is not None:
        env |= {"LD_PRELOAD": str(HOOK), "NVSHARE_SOCKET_DIR": str(daemon.socket_dir)}
    procs = {}
    try:
        for role in roles:
            kind = "infer" if role == "infer" else "train"
            procs[role] = subprocess.Popen(
                [
                    interpreter(role),
                    __file__,
                    kind,
                    str(seconds),
                    str(tmp / role),
                    str(tmp / f"r-{role}"),
                ],
                env=env,
            )
        deadline = time.monotonic() + 120
        while not all((tmp / f"r-{r}").exists() for r in roles):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"workers did not start: {[p.poll() for p in procs.values()]}")
            time.sleep(0.01)
        (tmp / "go").touch()
        for p in procs.values():
            p.wait(seconds + 60)
        out = {r: json.loads((tmp / r).read_text()) for r in roles}
        if daemon is not None:  # how often the lock moved, and why
            with daemon.control() as c:
                counters = c.request(StatusRequest()).doc["counters"]
            out["lock"] = {k: v for k, v in counters.items() if k.startswith(("grants", "drops"))}
        return out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        if daemon is not None:
            daemon.stop()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def latency(result: dict[str, Any]) -> dict[str, float]:
    ms = [x * 1000 for x in result["latencies_s"]]
    return {"p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "max_ms": max(ms), "requests": len(ms)}


def rate(result: dict[str, Any]) -> float:
    return float(result["steps"] / result["seconds"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--share-seconds", type=float, default=24.0, help="the 30/70 pair's run")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--part", choices=["a", "b", "both"], default="both")
    ap.add_argument("--repeat", type=int, default=1, help="repetitions of each part")
    args = ap.parse_args()
    s = args.seconds
    on = "scheduler: {mode: 'on', timeQuantum: 5s}"
    on_now = "scheduler: {mode: 'on', timeQuantum: 5s, reclaimAhead: 0}"  # nothing kept ahead
    off = "scheduler: {mode: 'off', timeQuantum: 5s}"
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "seconds": s,
    }
    if args.part in ("a", "both"):
        # Each repetition runs everything once, side by side in time; ratios are against the
        # same repetition's alone runs (the machine is shared and noisy).
        res["a"] = {"runs": []}
        for _ in range(args.repeat):
            alone_i = latency(run(on, ["infer"], s)["infer"])
            alone_t = rate(run(on, ["train"], s)["train"])
            rep: dict[str, Any] = {"infer_alone": alone_i, "train_alone_steps_per_s": alone_t}
            for name, policy in {"on": on, "on_no_ahead": on_now, "off": off}.items():
                pair = run(policy, ["infer", "train"], s)
                r = {"infer": latency(pair["infer"]), "train_steps_per_s": rate(pair["train"])}
                r["p99_ratio"] = r["infer"]["p99_ms"] / alone_i["p99_ms"]
                r["p50_ratio"] = r["infer"]["p50_ms"] / alone_i["p50_ms"]
                r["train_ratio"] = r["train_steps_per_s"] / alone_t
                r["lock"] = pair.get("lock", {})
                rep[name] = r
            res["a"]["runs"].append(rep)
            save(res, args.json)  # what a run cut short by a time limit has done so far
        for name in ("on", "on_no_ahead", "off"):
            for key in ("p99_ratio", "train_ratio"):
                values = [rep[name][key] for rep in res["a"]["runs"]]
                res["a"][f"{name}_{key}_median"] = statistics.median(values)
    if args.part in ("b", "both"):
        # The trainer alone, then with coreRequest 30 alone, then the 30/70 pair; a share is
        # the pair's steps/s over the solo rate, the mean of the two alone runs (the same
        # program alone on the GPU: a request limits nothing when nobody else wants the GPU).
        res["b"] = {"runs": [], "pair_seconds": args.share_seconds}
        for _ in range(args.repeat):
            solo = rate(run(on, ["train"], s)["train"])
            alone = rate(run(on, ["r30"], s)["r30"])
            both = run(on, ["r30", "r70"], args.share_seconds)
            r30, r70, base = rate(both["r30"]), rate(both["r70"]), (solo + alone) / 2
            res["b"]["runs"].append(
                {
                    "train_alone_steps_per_s": solo,
                    "r30_alone_share": alone / solo,
                    "r30_share": r30 / base,
                    "r70_share": r70 / base,
                    "r30_of_pair": r30 / (r30 + r70),  # the split, free of the solo runs' noise
                    "lock": both.get("lock", {}),
                }
            )
            save(res, args.json)
        for key in ("r30_alone_share", "r30_share", "r70_share", "r30_of_pair"):
            values = [rep[key] for rep in res["b"]["runs"]]
            res["b"][f"{key}_median"] = statistics.median(values)
    save(res, args.json)
    print(json.dumps(res, indent=2))
    return 0


def save(res: dict[str, Any], path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("infer", "train"):
        worker = infer if sys.argv[1] == "infer" else train
        worker(float(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        sys.exit(main())
