"""A workload suite that no single loop can be tuned to: every scheduling feature on one GPU.

Workers are ordinary PyTorch programs under the hook, each started by its own hard link of the
interpreter (`*-nvs-ROLE`) so policy rules can tell them apart by executable:

  train:SHAPE    a 4-layer 4096-wide bf16 MLP, forward, backward and SGD step; each step ends the
                 way real loops do: `item` (loss.item()), `cpu` (loss.cpu()), `event` (an event
                 recorded and synchronised), `pinned` (a blocking copy_ into pinned memory),
                 `loader` (batches from a DataLoader with 2 workers and pinned memory, then
                 .item()), `sync` (torch.cuda.synchronize(), the shape older benchmarks used)
  compiled       the same model, forward only, under torch.compile(mode="reduce-overhead") (CUDA
                 graphs), .item() each step
  infer:ARRIVAL:MS[:graph|:decode[:GAP_MS]]
                 requests of about MS ms of GPU work (4096-wide fp16 layers), `steady` (one every
                 50 ms) or `poisson` (exponential gaps, mean 50 ms, fixed seed), or `once` (one,
                 then idle to the end: it lends its GPU the whole run); `graph` replays
                 the request as a captured CUDA graph; `decode` runs it as a token generator
                 does, in 8 steps, each read back with .item() and followed by GAP_MS (0.2) ms
                 of host work; latency from submission to its result

Every worker writes the wall time at which each step (or request) finished, so the report can
say what a user would see: each one's rate over the time both ran, the split, the longest time a
job made no step, throughput shares from the first second.

Sections (each pair also runs each member alone, in the same call, for its ratios):
  turns      two trainers at TQ 5 s, mode on, the second started 0.5 s after the first, for every
             step shape, and mixed pairs in both start orders (--turns-seconds each): split and
             longest stall
  modes      two `train:item` in modes on / auto / off: combined rate against one alone
  quotas     `train:item` at coreLimit 25 / 50 / 75, `compiled` at 30, and a 25/75 pair:
             throughput share over the first 1 s, the first 8 s and the whole run
             (--quota-seconds), against the same loop alone; and shares of time: work
             with the SM clock divided out, and NVML's utilization against the loop alone
  priorities an inference loop at priority high beside `train:item` at low (steady and Poisson,
             eager, graph and decode), and beside a trainer that lowers itself
             (NVSHARE_GPU_PRIORITY);
             p99 against alone and against mode off, the trainer's rate against alone
  requests   two trainers with coreRequest 30 and 70 (--quota-seconds): work and time held
  crowd      three `train:item`, then `item`, `cpu`, `loader` and `compiled` loops in both
             orders, two `loader` loops with an `item` and a `cpu` one, and a `loader` with
             two `item` loops, at TQ 5 s, staggered starts, three rounds of turns: each
             loop's share (1/N is fair) and longest stall (the others' quanta and a drop
             deadline bound it); an `item` or a `loader` loop that lowers itself beside
             three `item` loops, each waiting past a starvation limit of 8 s for its turn;
             and a `loader` with two `item` loops at the default quantum (30 s), two rounds

    python3 bench/workloads.py [--sections turns,modes,...] [--seconds 12] [--json OUT]
                               [--infer steady:1,poisson:8:graph,...]
                               [--quota-seconds 20] [--quota-cases 25,75,30c,pair]
                               [--quota-variants ';computeWindow: 250ms']
                               [--priority-variants ';idleHandoff: 2ms'] [--base OLD_CHECKOUT]
                               [--trainer compiled]
                               [--crowds 'item x3;item x3'] [--trace DIR]
    (needs PyTorch, a GPU, the appliance importable and ld_hook/build/libnvshare.so built;
    2-GPU jobs are bench/gangs.py's)
"""

from __future__ import annotations

import argparse
import bisect
import functools
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _daemon import BenchDaemon, gpus, machine, percentile, stamp_hook_lines

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "ld_hook" / "build" / "libnvshare.so"
TQ_S = 5.0  # every section's time quantum
QUOTA_SECONDS = 20.0  # each quota run: long enough to see the share settle after 8 s
TURNS_SECONDS = 40.5  # each turns pair: eight whole quanta after the second loop's 0.5 s
TRACE: Path | None = None  # --trace DIR: every run's hook debug lines, timed, kept there
QUOTA_CASES = ("25", "50", "75", "30c", "pair")  # coreLimit [c: the compiled loop], a 25/75 pair
# ARRIVAL:MS[:graph|:decode[:GAP_MS]]: the 1-10 ms of work a request, steady and
# Poisson, eager and graphs; `decode`: as a token generator, each request DECODE_STEPS steps,
# each read back (`.item()`) and followed by GAP_MS (DECODE_GAP_S) of host work (sampling, the
# next step's batch)
INFER = (
    "steady:1",
    "poisson:1",
    "steady:8:graph",
    "poisson:8:graph",
    "poisson:10",
    "poisson:10:decode",
)
DECODE_STEPS, DECODE_GAP_S = 8, 0.0002
RULES = """
rules:
  - {name: high, match: {executable: '*-nvs-hi*'}, priority: high}
  - {name: low, match: {executable: '*-nvs-lo*'}, priority: low}
  - {name: q25, match: {executable: '*-nvs-q25*'}, coreLimit: 25}
  - {name: q30, match: {executable: '*-nvs-q30*'}, coreLimit: 30}
  - {name: q50, match: {executable: '*-nvs-q50*'}, coreLimit: 50}
  - {name: q75, match: {executable: '*-nvs-q75*'}, coreLimit: 75}
  - {name: r30, match: {executable: '*-nvs-r30*'}, coreRequest: 30}
  - {name: r70, match: {executable: '*-nvs-r70*'}, coreRequest: 70}
"""


# ------------------------------------------------------------------ workers (under the hook)


def _wait_for_go(ready: Path, delay: float) -> None:
    ready.touch()
    go = ready.parent / "go"
    while not go.exists():
        time.sleep(0.002)
    time.sleep(delay)


def _end_step(shape: str) -> Any:
    """How a step ends: the call that waits for the loss, as real training loops write it."""
    import torch

    pinned = torch.empty(1, pin_memory=True)

    def event(loss: Any) -> None:
        done = torch.cuda.Event()
        done.record()
        done.synchronize()

    endings = {
        "item": lambda loss: loss.item(),
        "loader": lambda loss: loss.item(),
        "cpu": lambda loss: loss.detach().cpu(),
        "event": event,
        "pinned": lambda loss: pinned.copy_(loss.detach().reshape(1).float()),
        "sync": lambda loss: torch.cuda.synchronize(),
    }
    if shape not in endings:
        raise SystemExit(f"unknown step shape {shape!r}")
    return endings[shape]


def _batches(shape: str, x: Any) -> Any:
    """The step's input: the same tensor, or for `loader` the next batch of a DataLoader."""
    import torch

    if shape != "loader":
        return lambda: x
    data = torch.utils.data.TensorDataset(torch.randn(64 * 512, 4096))
    loader = torch.utils.data.DataLoader(
        data, batch_size=512, num_workers=2, pin_memory=True, persistent_workers=True
    )
    batches = iter(loader)

    def next_batch() -> Any:
        nonlocal batches
        batch = next(batches, None)
        if batch is None:
            batches = iter(loader)
            batch = next(batches)
        return batch[0].to("cuda", torch.bfloat16, non_blocking=True).repeat(4, 1)

    return next_batch


def _trainer(shape: str) -> Any:
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)])
    model = model.to("cuda", torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    if shape == "compiled":
        compiled = torch.compile(model, mode="reduce-overhead")

        def inference_step() -> None:
            with torch.no_grad():
                compiled(x).float().square().mean().item()

        return inference_step
    batch, end = _batches(shape, x), _end_step(shape)

    def step() -> None:
        loss = model(batch()).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end(loss)

    return step


def train(spec: str, seconds: float, out: Path, ready: Path, delay: float) -> None:
    shape = "compiled" if spec == "compiled" else spec.split(":")[1]
    step = _trainer(shape)
    for _ in range(10 if shape != "compiled" else 20):  # warm-up (and compile) before the start
        step()
    _wait_for_go(ready, delay)
    ends, start = [], time.time()
    while time.time() < start + seconds - delay:
        step()
        ends.append(time.time())
    out.write_text(json.dumps({"start": start, "ends": ends}))


def infer(spec: str, seconds: float, out: Path, ready: Path, delay: float) -> None:
    import torch

    _, arrival, work_ms, *how = spec.split(":")
    depth = max(1, round(float(work_ms) / 0.25))  # about 0.25 ms a 4096^3 fp16 layer on an H100
    layers = [torch.randn(4096, 4096, device="cuda", dtype=torch.float16) / 64] * depth
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    decode = how[:1] == ["decode"]  # as a token generator: DECODE_STEPS steps, each read back
    gap_s = float(how[1]) / 1e3 if decode and len(how) > 1 else DECODE_GAP_S

    def forward() -> Any:
        y = x
        for i, w in enumerate(layers):
            y = torch.relu(y @ w)
            if decode and (i + 1) % max(1, depth // DECODE_STEPS) == 0:
                y[0, 0].item()  # the sampled token, then the host picks the next step's input
                spin_until = time.perf_counter() + gap_s
                while time.perf_counter() < spin_until:
                    pass
        return y

    replay = None
    if how == ["graph"]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            forward()
        replay = g.replay

    def request() -> float:
        t0 = time.perf_counter()
        replay() if replay is not None else forward()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(20):
        request()
    _wait_for_go(ready, delay)
    rng = random.Random(7)
    latencies, ends = [], []
    start = time.time()
    next_at = time.perf_counter()
    stop_at = next_at + seconds - delay
    while next_at < stop_at:
        latencies.append(request())
        ends.append(time.time())
        gap = {"poisson": rng.expovariate(1 / 0.05), "once": seconds}.get(arrival, 0.05)
        next_at += gap
        time.sleep(max(0.0, next_at - time.perf_counter()))
    out.write_text(json.dumps({"start": start, "ends": ends, "latencies_s": latencies}))


# ------------------------------------------------------------------ running workers together


@dataclass(frozen=True)
class Role:
    name: str  # also the executable's suffix: policy rules match on it
    spec: str  # train:SHAPE, compiled, infer:ARRIVAL:MS[:graph|:decode[:GAP_MS]]
    delay: float = 0.0  # seconds after the common start
    env: dict[str, str] = field(default_factory=dict)


def interpreter(role: str) -> str:
    """The interpreter under a name for the role, beside it (so it finds the same prefix)."""
    real = os.path.realpath(sys.executable)
    named = f"{real}-nvs-{role}"
    if not os.path.exists(named):
        try:
            os.link(real, named)
        except OSError:
            shutil.copy2(real, named)
    return named


class GpuSampler:
    """GPU 0's SM clock and utilization (NVML's share of time a kernel ran, over its own sample
    period) every 50 ms while the workers run: a GPU running at low duty can clock higher, and
    then does more work per second of GPU time than it does alone."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        self._samples: list[tuple[float, int, int]] = []  # (wall time, SM MHz, utilization %)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        nvml, gpu = self._nvml, self._gpu
        while not self._stop.wait(0.05):
            mhz = nvml.nvmlDeviceGetClockInfo(gpu, nvml.NVML_CLOCK_SM)
            util = nvml.nvmlDeviceGetUtilizationRates(gpu).gpu
            self._samples.append((time.time(), mhz, util))

    def stop(self) -> list[tuple[float, int, int]]:
        self._stop.set()
        self._thread.join()
        return self._samples


def gpu_between(samples: list[list[float]], lo: float, hi: float) -> tuple[float, float]:
    """(SM MHz while busy, mean utilization %) over [lo, hi]: the clock weighted by
    utilization, so idle stretches at a lower clock do not count."""
    inside = [(mhz, util) for t, mhz, util in samples if lo <= t <= hi]
    busy = sum(util for _, util in inside)
    mhz = sum(m * u for m, u in inside) / busy if busy else 0.0
    return mhz, busy / max(1, len(inside))


def run(
    policy: str | None, roles: list[Role], seconds: float, tree: Path | None = None
) -> dict[str, Any]:
    """The roles together under the hook and a daemon with `policy` (None: no hook, no daemon),
    the daemon of checkout `tree` if given (side by side with an older commit), and its hook
    where it has one built.
    Each role's result also carries `gpu`, the GPU's samples while they ran (`GpuSampler`)."""
    daemon = BenchDaemon(policy + RULES, tree=tree) if policy is not None else None
    tmp = Path(tempfile.mkdtemp(prefix="nvs-suite-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env |= _hook_env(daemon, tree)
    trace = TRACE is not None and daemon is not None
    procs: dict[str, subprocess.Popen[bytes]] = {}
    lines: dict[str, list[tuple[float, str]]] = {r.name: [] for r in roles}
    try:
        for r in roles:
            argv = [interpreter(r.name), __file__, "--worker", r.spec, str(seconds)]
            argv += [str(tmp / r.name), str(tmp / f"ready-{r.name}"), str(r.delay)]
            stderr = subprocess.PIPE if trace else None
            procs[r.name] = subprocess.Popen(argv, env={**env, **r.env}, stderr=stderr)
            stamp_hook_lines(procs[r.name], lines[r.name], time.time)  # (when traced)
        deadline = time.monotonic() + 300  # torch.compile's first compile is slow
        while not all((tmp / f"ready-{r.name}").exists() for r in roles):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"workers did not start: {[p.poll() for p in procs.values()]}")
            time.sleep(0.01)
        sampler = GpuSampler()
        (tmp / "go").touch()
        for p in procs.values():
            p.wait(seconds + 120)
        samples = sampler.stop()
        out = {r.name: json.loads((tmp / r.name).read_text()) | {"gpu": samples} for r in roles}
        if trace:
            for r in roles:
                out[r.name]["trace"] = [(t, x) for t, x in lines[r.name] if "lock" in x]
            kept = ("start", "ends", "trace", "latencies_s")
            keep = {n: {k: r[k] for k in kept if k in r} for n, r in out.items()}
            (TRACE / f"{tmp.name}.json").write_text(json.dumps(keep | {"policy": policy}))
        return out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        if daemon is not None:
            daemon.stop()


def _hook_env(daemon: BenchDaemon | None, tree: Path | None) -> dict[str, str]:
    """What puts a worker under the hook (the one of `tree`, where built) and `daemon`."""
    if daemon is None:
        return {}
    built = tree / HOOK.relative_to(ROOT) if tree is not None else HOOK
    hook = built if built.exists() else HOOK
    env = {"LD_PRELOAD": str(hook), "NVSHARE_SOCKET_DIR": str(daemon.socket_dir)}
    return env | ({"NVSHARE_DEBUG": "1"} if TRACE is not None else {})


def hand_offs(inf: dict[str, Any], trn: dict[str, Any]) -> dict[str, Any]:
    """From the hooks' traces (--trace): what the GPU loses around the requests of an inference
    loop that outranks a trainer. Per request, median ms: `wait` from the inference asking to
    its grant (it is granted beside the trainer's drain, so the GPU works meanwhile),
    `idle_detect` from a request's result to the inference's idle release, `back` from that
    release to the trainer's grant; `lost_pct`: the last two summed over the run, as a share of
    it (the GPU idle, neither of them holding work). Where the trainer's time goes, over the
    time both ran: `trainer_held_pct` the share it held the lock, `trainer_held_steps_s` its
    steps a second while it held it (against its solo rate: what holding the GPU it borrows
    costs it, `borrowerQueue`'s pacing say), `infer_busy_pct` the share the inference's
    requests took from asking to result. Its rate is the first times the second: what the
    requests take is the GPU's, what it holds at a slower pace than alone is the scheduler's."""

    def at(r: dict[str, Any], what: str) -> list[float]:
        return [t for t, x in r["trace"] if what in x]

    def gaps(froms: list[float], tos: list[float], within: float) -> list[float]:
        """For each of `tos`, the time since the latest of `froms` before it (within)."""
        out = []
        for t in tos:
            last = next((f for f in reversed(froms) if f <= t), None)
            if last is not None and t - last < within:
                out.append(t - last)
        return out

    idles = at(inf, "released (idle)")
    found = {
        "wait": gaps(at(inf, "requesting the lock"), at(inf, "lock granted"), 1.0),
        "idle_detect": gaps(inf["ends"], idles, 1.0),
        "back": gaps(idles, at(trn, "lock granted"), 0.05),
    }
    span = max(inf["ends"][-1] - inf["start"], 1e-9)
    out: dict[str, Any] = {
        k: {"n": len(v), "p50_ms": round(1e3 * percentile(v, 50), 3) if v else None}
        for k, v in found.items()
    }
    out["lost_pct"] = round(100 * (sum(found["idle_detect"]) + sum(found["back"])) / span, 2)
    lo, hi = overlap({"inf": inf, "trn": trn})
    holds, since = [], None  # the trainer's (granted, released), clipped to [lo, hi]
    for t, x in trn["trace"]:
        if "lock granted" in x:
            since = t
        elif "lock released" in x and since is not None:
            holds.append((max(since, lo), min(t, hi)))
            since = None
    if since is not None:
        holds.append((max(since, lo), hi))
    holds = [(a, b) for a, b in holds if b > a]
    held_s = sum(b - a for a, b in holds)
    steps = sum(steps_between(trn, a, b) for a, b in holds)
    busy = sum(x for t, x in zip(inf["ends"], inf["latencies_s"], strict=True) if lo <= t < hi)
    out["trainer_held_pct"] = round(100 * held_s / max(hi - lo, 1e-9), 1)
    out["trainer_held_steps_s"] = round(steps / max(held_s, 1e-9), 1)
    out["infer_busy_pct"] = round(100 * busy / max(hi - lo, 1e-9), 1)
    return out


# ------------------------------------------------------------------ what a user would measure


def steps_between(result: dict[str, Any], lo: float, hi: float) -> int:
    return sum(1 for t in result["ends"] if lo <= t < hi)


def overlap(results: dict[str, Any]) -> tuple[float, float]:
    """From the last one's start to the first one's end: the time every worker ran."""
    lo = max(r["start"] for r in results.values())
    hi = min(r["ends"][-1] if r["ends"] else r["start"] for r in results.values())
    return lo, hi


def longest_stall(result: dict[str, Any], lo: float, hi: float) -> float:
    """The longest time in [lo, hi) in which the worker finished no step."""
    marks = [lo, *(t for t in result["ends"] if lo <= t < hi), hi]
    return max(b - a for a, b in itertools.pairwise(marks))


def pair_report(pair: dict[str, Any], alone: dict[str, float]) -> dict[str, Any]:
    lo, hi = overlap(pair)
    span = max(hi - lo, 1e-9)
    rates = {n: steps_between(r, lo, hi) / span for n, r in pair.items()}
    shares = {n: rates[n] / alone[n] for n in pair}  # each against itself alone
    total = sum(shares.values()) or 1.0
    return {
        "both_ran_s": round(span, 2),
        "split_pct": {n: round(100 * s / total, 1) for n, s in shares.items()},
        "combined_of_alone": round(total, 3),
        "longest_stall_s": {n: round(longest_stall(r, lo, hi), 2) for n, r in pair.items()},
    }


def rate(result: dict[str, Any], first_s: float | None = None) -> float:
    start = result["start"]
    end = start + first_s if first_s is not None else result["ends"][-1]
    return steps_between(result, start, end) / max(end - start, 1e-9)


def held(result: dict[str, Any], first_s: float | None = None) -> tuple[float, float]:
    """(share of the run, or of its first `first_s`, the loop made steps in; its step rate
    there): a quota's share of work is the first times the second against the loop alone. A
    pause is a gap between two steps over three median steps (of the whole run); it held
    nothing but its one step's worth of it. A span that ends inside a pause counts it."""
    start, ends = result["start"], result["ends"]
    gaps = [b - a for a, b in itertools.pairwise([start, *ends])]
    step = sorted(gaps)[len(gaps) // 2]
    end = start + first_s if first_s is not None else ends[-1]
    marks = [start, *(t for t in ends if t < end), end]
    spans = [b - a for a, b in itertools.pairwise(marks)]
    active = end - start - sum(g - step for g in spans if g > 3 * step)
    return active / (end - start), sum(1 for t in ends if t <= end) / active


def latency(result: dict[str, Any]) -> dict[str, float]:
    ms = [x * 1000 for x in result["latencies_s"]]
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "n": len(ms)}


# ------------------------------------------------------------------ sections


def told(case: str, result: dict[str, Any]) -> dict[str, Any]:
    """A case's result, printed as it comes (a call cut short by its time limit keeps it)."""
    print(f"# {case}: {json.dumps(result)}", flush=True)
    return result


def on_policy(mode: str = "on", settings: str = "", tq_s: float = TQ_S) -> str:
    """The scheduler's policy; `settings`: more of its fields, as YAML flow items."""
    more = f", {settings}" if settings else ""
    return f"scheduler: {{mode: '{mode}', timeQuantum: {tq_s:g}s{more}}}"


def alone_rates(specs: dict[str, str], seconds: float) -> dict[str, float]:
    """Each role's rate alone under the hook (mode on, nothing to share with)."""
    return {
        name: rate(run(on_policy(), [Role(name, spec)], seconds)[name])
        for name, spec in specs.items()
    }


def section_turns(alone_s: float, seconds: float = TURNS_SECONDS) -> dict[str, Any]:
    """Every step shape's pair, and the mixed pairs in both orders, for `seconds` each: whole
    quanta, so that a 50/50 split is what alternating turns give over the time both ran (each
    loop's rate alone over `alone_s`)."""
    out: dict[str, Any] = {}
    shapes = ["item", "cpu", "event", "pinned", "loader", "sync"]
    solo = alone_rates({f"t{s}": f"train:{s}" for s in shapes}, alone_s)
    solo |= alone_rates({"tcompiled": "compiled"}, alone_s)
    for shape in shapes:
        a, b = f"t{shape}", f"t{shape}2"
        pair = run(
            on_policy(), [Role(a, f"train:{shape}"), Role(b, f"train:{shape}", 0.5)], seconds
        )
        out[f"{shape}+{shape}"] = told(
            f"{shape}+{shape}", pair_report(pair, {a: solo[a], b: solo[a]})
        )
    for first, second in (
        ("titem", "tloader"),
        ("tloader", "titem"),
        ("tcompiled", "titem"),
        ("titem", "tcompiled"),
    ):
        specs = {"titem": "train:item", "tloader": "train:loader", "tcompiled": "compiled"}
        roles = [Role(first, specs[first]), Role(second, specs[second], 0.5)]
        pair = run(on_policy(), roles, seconds)
        out[f"{first}->{second}"] = told(f"{first}->{second}", pair_report(pair, solo))
    return out


CROWDS = {  # N loops at TQ 5 s, staggered starts (s) at no round figure, in two orders
    "item x3": (("titem", 0.0), ("titem2", 0.5), ("titem3", 1.0)),
    "item,cpu,loader,compiled": (
        ("titem", 0.0),
        ("tcpu", 0.7),
        ("tloader", 1.3),
        ("tcompiled", 2.1),
    ),
    "compiled,loader,cpu,item": (
        ("tcompiled", 0.0),
        ("tloader", 0.4),
        ("tcpu", 1.1),
        ("titem", 1.9),
    ),
    "loader x2,item,cpu": (  # two that pause: one lends while it borrows from the other
        ("tloader", 0.0),
        ("tloader2", 0.6),
        ("titem", 1.2),
        ("tcpu", 1.9),
    ),
    "loader,item x2": (  # what the loader lends: to the loop behind it, or round both
        ("tloader", 0.0),
        ("titem", 0.6),
        ("titem2", 1.3),
    ),
    # A loop that lowers itself (NVSHARE_GPU_PRIORITY=low: the names "l...") among three that
    # each wait two quanta (10 s) for their turns, past a starvation limit of 8 s (`STARVED`):
    # as at the defaults with three loops, where the quantum is the limit.
    "low item,item x3": (("titem", 0.0), ("titem2", 0.5), ("titem3", 1.1), ("litem", 1.6)),
    "low loader,item x3": (("titem", 0.0), ("titem2", 0.5), ("titem3", 1.1), ("lloader", 1.6)),
    # The loader beside two `.item()` loops at the default quantum (30 s, the starvation limit):
    # each waits two quanta, past the limit, for its turn.
    "loader,item x2 at the defaults": (("tloader", 0.0), ("titem", 0.6), ("titem2", 1.3)),
}
CROWD_ROUNDS = 3  # each case runs this many rounds of every loop's quantum after the last start
# cases not at TQ 5 s and the default starvation limit: (more settings, quantum s, rounds)
CROWD_AT = {
    "low item,item x3": ("starvationLimit: 8s", TQ_S, CROWD_ROUNDS),
    "low loader,item x3": ("starvationLimit: 8s", TQ_S, CROWD_ROUNDS),
    "loader,item x2 at the defaults": ("", 30.0, 2),
}
LOW = {"NVSHARE_GPU_PRIORITY": "low"}


def section_crowd(
    alone_s: float, cases: tuple[str, ...] = tuple(CROWDS), base: Path | None = None
) -> dict[str, Any]:
    """Three and four loops at once (no benchmark pair is a crowd): each loop's share of its own
    rate alone over the time all ran, which turns give as 1/N each, and the longest time a loop
    made no step, which turns bound by the others' quanta and a drop deadline. Each of `cases`
    (names in `CROWDS`; a name given again runs again, its result as "NAME #2"); and each once
    more under the daemon of checkout `base` if given ("NAME @base")."""
    specs = {"titem": "train:item", "tcpu": "train:cpu", "tloader": "train:loader"}
    specs["tcompiled"] = "compiled"
    specs |= {"litem": "train:item", "lloader": "train:loader"}
    kinds = {name.rstrip("0123456789") for c in cases for name, _ in CROWDS[c]}
    solo = alone_rates({k: specs[k] for k in kinds}, alone_s)
    runs = [(case, None) for case in cases] + [(case, base) for case in cases if base]
    out: dict[str, Any] = {}
    for i, (case, tree) in enumerate(runs):
        members = CROWDS[case]
        again = [c for c, t in runs[:i] if t is tree].count(case)
        kind = {name: name.rstrip("0123456789") for name, _ in members}  # titem2: a titem
        roles = [
            Role(name, specs[kind[name]], delay, LOW if name.startswith("l") else {})
            for name, delay in members
        ]
        settings, tq_s, rounds = CROWD_AT.get(case, ("", TQ_S, CROWD_ROUNDS))
        seconds = rounds * len(roles) * tq_s + members[-1][1]
        got = run(on_policy(settings=settings, tq_s=tq_s), roles, seconds, tree)
        report = pair_report(got, {name: solo[k] for name, k in kind.items()})
        if TRACE is not None:
            idle = {n: [t for t, x in r["trace"] if "released (idle)" in x] for n, r in got.items()}
            report["taking_back"] = {
                n: taking_back(r, sorted(t for o in got if o != n for t in idle[o]))
                for n, r in got.items()
            }
        name = (f"{case} #{again + 1}" if again else case) + (" @base" if tree else "")
        out[name] = told(name, report | {"loops": len(roles)})
    return out


def taking_back(r: dict[str, Any], others_lent: list[float]) -> dict[str, Any]:
    """From a loop's traced lock lines (--trace): its requests after lending its GPU inside its
    quantum (an idle release, then a request within TQ_S of its last grant that was neither
    such a taking back nor a borrow, a grant within 5 ms of another loop's idle release), how
    many, and the longest any waited for its grant (a drain, if the borrower gives way at
    once). What it lent while it borrowed it does not take back, and is not counted; a
    borrow the traces cannot tell (granted a quantum its lender left idle for longer, as when
    the warm-up ends) is taken for the loop's own, and what it lends on from it waits its
    turn: a wait of a turn here is only a failure where no such borrow came before."""
    quantum_from, lent, asked, back, waits = 0.0, False, None, False, []
    for t, line in r["trace"]:
        if "lock granted" in line:
            if asked is not None and back:
                waits.append(t - asked)
            elif asked is not None:
                i = bisect.bisect_right(others_lent, t)
                borrow = i > 0 and t - others_lent[i - 1] < 0.005
                quantum_from = float("-inf") if borrow else t  # (a borrow: no quantum of its own)
            asked = None
        elif "released (idle)" in line:
            lent = True
        elif "released" in line:
            lent = False
        elif "requesting the lock" in line:
            asked, back, lent = t, lent and t < quantum_from + TQ_S, False
    return {"n": len(waits), "longest_s": round(max(waits), 3) if waits else None}


def section_modes(seconds: float) -> dict[str, Any]:
    solo = alone_rates({"a": "train:item"}, seconds)["a"]
    out = {}
    for mode in ("on", "auto", "off"):
        pair = run(
            on_policy(mode), [Role("a", "train:item"), Role("b", "train:item", 0.5)], seconds
        )
        out[mode] = told(mode, pair_report(pair, {"a": solo, "b": solo}))
    return out


def section_quotas(
    _seconds: float,
    long: float = QUOTA_SECONDS,
    variants: tuple[str, ...] = ("",),
    cases: tuple[str, ...] = QUOTA_CASES,
) -> dict[str, Any]:
    """Shares of work as a user measures them: steps in the first 1 s, 8 s and the whole run
    against the same loop alone over the same spans. `time_share_*` divides out the SM clock
    (while busy): the share of GPU time the work took, if the loop's speed follows the clock;
    `util_share_*` (a loop alone under its quota) is NVML's time with a kernel running against
    the loop's alone, a measure of time that needs no clock (NVML averages over its own sample
    period, up to a second: not given for the first second). Each of `variants` (more
    scheduler settings, "" for the defaults) runs each of `cases` (`QUOTA_CASES`)."""
    limited = [(int(c[:2]), c[2:] or "t") for c in cases if c != "pair"]
    solo = {
        base: run(on_policy(), [Role(base, spec)], long)[base]
        for base, spec in (("t", "train:item"), ("c", "compiled"))
        if base == "t" or ("c" in {b for _, b in limited})
    }
    spans = {"1s": 1.0, "8s": 8.0, "whole": None}

    def shares(r: dict[str, Any], base: str, alone: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, first in spans.items():
            work = 100 * rate(r, first) / rate(solo[base], first)
            ran, ran_solo = (
                gpu_between(x["gpu"], x["start"], x["start"] + first if first else x["ends"][-1])
                for x in (r, solo[base])
            )
            out[f"share_{k}"] = round(work, 1)
            out[f"time_share_{k}"] = round(work * ran_solo[0] / max(1.0, ran[0]), 1)
            out[f"held_{k}"] = round(100 * held(r, first)[0], 1)
            if alone and first != 1.0:
                out[f"util_share_{k}"] = round(100 * ran[1] / max(1.0, ran_solo[1]), 1)
            if first is None:
                out |= {"busy_mhz": round(ran[0]), "solo_busy_mhz": round(ran_solo[0])}
                part, pace = held(r)
                out |= {
                    "held_pct": round(100 * part, 1),
                    "pace_of_solo": round(pace / rate(solo[base]), 3),
                }
        return out

    out: dict[str, Any] = {}
    for settings in variants:
        policy = on_policy(settings=settings)
        row: dict[str, Any] = {}
        for pct, base in limited:
            name, spec = f"q{pct}{base}", "compiled" if base == "c" else "train:item"
            got = shares(run(policy, [Role(name, spec)], long)[name], base)
            row[name] = told(f"{settings} {name}", {"limit": pct, **got})
        if "pair" in cases:
            pair = run(policy, [Role("q25a", "train:item"), Role("q75a", "train:item")], long)
            got = {n: shares(r, "t", alone=False) for n, r in pair.items()}
            row["25+75"] = told(f"{settings} 25+75", got)
        out[settings or "defaults"] = row
    return out


def section_priorities(
    seconds: float,
    infer: tuple[str, ...] = INFER,
    variants: tuple[str, ...] = ("",),
    base: Path | None = None,
    trainer: str = "train:item",
) -> dict[str, Any]:
    """Each request shape alone, then beside a trainer (`trainer`, a worker spec): at priority
    high (by rule), beside a trainer that lowers itself (and two), and with mode off; the
    mode-on cases once per `variants` (more scheduler settings, "" for the defaults), keyed
    `on[SETTINGS]` beyond the first, and once under the daemon of checkout `base`, keyed
    `on@base`. The trainer runs alone before the pairs and again after them, and its rates
    in the pairs are against the mean of the two: on a shared GPU its solo rate drifts by up
    to a tenth from run to run (`trainer_solo_steps_s` shows both)."""
    out: dict[str, Any] = {}
    solo_before = alone_rates({"lot": trainer}, seconds)["lot"]
    trainer_rates: list[tuple[dict[str, Any], str, float]] = []  # (a case's result, key, rate)
    for request in infer:
        spec = f"infer:{request}"
        alone = latency(run(on_policy(), [Role("hii", spec)], seconds)["hii"])
        row: dict[str, Any] = {
            "alone_p50_ms": round(alone["p50_ms"], 3),
            "alone_p99_ms": round(alone["p99_ms"], 3),
        }
        cases: dict[str, tuple[str, list[Role], Path | None]] = {}
        for settings in variants:
            tag = f"[{settings}]" if settings else ""
            cases |= priority_cases(spec, trainer, tag, on_policy(settings=settings))
        if base is not None:
            cases |= priority_cases(spec, trainer, "@base", on_policy(), base)
        cases["off"] = (on_policy("off"), [Role("hii", spec), Role("lot", trainer)], None)
        for case, (policy, roles, tree) in cases.items():
            pair = run(policy, roles, seconds, tree)
            inf, trn, *more = (pair[r.name] for r in roles)
            steps_s = rate(trn)
            got: dict[str, Any] = {
                "p99_ms": round(latency(inf)["p99_ms"], 3),
                "p99_x_alone": round(latency(inf)["p99_ms"] / alone["p99_ms"], 2),
                "trainer_steps_s": round(steps_s, 3),
                "longest_stall_s": round(longest_stall(inf, inf["start"], inf["ends"][-1]), 2),
            }
            trainer_rates.append((got, "trainer_of_solo", steps_s))
            if more:  # (the second trainer)
                trainer_rates.append((got, "trainer2_of_solo", rate(more[0])))
            if TRACE is not None:
                got["hand_offs"] = hand_offs(inf, trn)
            row[case] = told(f"{spec} {case}", got)
        out[spec] = row
    solo_after = alone_rates({"lot": trainer}, seconds)["lot"]
    solo = (solo_before + solo_after) / 2
    for got, key, trainer_steps_s in trainer_rates:
        got[key] = round(trainer_steps_s / solo, 2)
        if key == "trainer_of_solo" and "hand_offs" in got:  # (--trace)
            held = got["hand_offs"]["trainer_held_steps_s"]
            got["hand_offs"]["trainer_held_pace_of_solo"] = round(held / solo, 3)
    both = [round(solo_before, 3), round(solo_after, 3)]
    print(f"# trainer alone, before and after the pairs: {both} steps/s", flush=True)
    out["trainer_solo_steps_s"] = both
    return out


def priority_cases(
    spec: str, trainer: str, tag: str, policy: str, tree: Path | None = None
) -> dict[str, tuple[str, list[Role], Path | None]]:
    """The inference loop at high beside a trainer at low by rule, beside one that lowers
    itself through NVSHARE_GPU_PRIORITY, and beside two that do (they share what it lends)."""
    trn, trn2 = Role("trn", trainer, env=LOW), Role("trn2", trainer, 0.3, LOW)
    return {
        f"on{tag}": (policy, [Role("hii", spec), Role("lot", trainer)], tree),
        f"on_self_lowered{tag}": (policy, [Role("inf", spec), trn], tree),
        f"on_two_lowered{tag}": (policy, [Role("inf", spec), trn, trn2], tree),
    }


def section_requests(_seconds: float, long: float = QUOTA_SECONDS) -> dict[str, Any]:
    """Two trainers guaranteed 30 and 70, for `long` seconds (as quotas): they hold in blocks
    of a few seconds (the shorter share at the end of one request window and the start of the
    next), so a short run's split depends on where it starts and ends."""
    solo = alone_rates({"t": "train:item"}, long)["t"]
    pair = run(on_policy(), [Role("r30", "train:item"), Role("r70", "train:item")], long)
    return {
        n: told(n, {"work": round(100 * rate(r) / solo, 1), "held": round(100 * held(r)[0], 1)})
        for n, r in pair.items()
    }


SECTIONS = {
    "turns": section_turns,
    "modes": section_modes,
    "quotas": section_quotas,
    "priorities": section_priorities,
    "requests": section_requests,
    "crowd": section_crowd,
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quota-seconds", type=float, default=QUOTA_SECONDS)
    ap.add_argument("--turns-seconds", type=float, default=TURNS_SECONDS)
    ap.add_argument("--quota-cases", default=",".join(QUOTA_CASES))
    ap.add_argument(
        "--crowds", default=";".join(CROWDS), help="the crowd section's cases, ';' between them"
    )
    ap.add_argument(
        "--infer", default=",".join(INFER), help="ARRIVAL:MS[:graph|:decode[:GAP_MS]] requests"
    )
    ap.add_argument(
        "--quota-variants",
        default="",
        help="scheduler settings for the quotas section, ';' between variants ('' = defaults)",
    )
    ap.add_argument(
        "--priority-variants",
        default="",
        help="scheduler settings for the priorities section's mode-on cases, as --quota-variants",
    )
    ap.add_argument(
        "--base",
        type=Path,
        help="another checkout (an older commit): priorities' mode-on cases and the crowds also"
        " under its daemon and its hook (BASE/ld_hook/build/libnvshare.so, where built)",
    )
    ap.add_argument(
        "--trainer",
        default="train:item",
        help="the priorities section's trainer (a worker spec: train:SHAPE or compiled)",
    )
    ap.add_argument(
        "--trace",
        type=Path,
        help="run the hooks with NVSHARE_DEBUG, keep every run's timed lock lines and step times"
        " in this folder (one JSON file a run), and break the priorities' hand-offs down",
    )
    args = ap.parse_args()
    if unknown := set(args.crowds.split(";")) - set(CROWDS):
        ap.error(f"--crowds: no such case {sorted(unknown)}; the cases are {list(CROWDS)}")
    global TRACE
    TRACE = args.trace
    if TRACE is not None:
        TRACE.mkdir(parents=True, exist_ok=True)
    sections = SECTIONS | {
        "turns": functools.partial(section_turns, seconds=args.turns_seconds),
        "quotas": functools.partial(
            section_quotas,
            long=args.quota_seconds,
            variants=tuple(args.quota_variants.split(";")),
            cases=tuple(args.quota_cases.split(",")),
        ),
        "requests": functools.partial(section_requests, long=args.quota_seconds),
        "crowd": functools.partial(
            section_crowd, cases=tuple(args.crowds.split(";")), base=args.base
        ),
        "priorities": functools.partial(
            section_priorities,
            infer=tuple(args.infer.split(",")),
            variants=tuple(args.priority_variants.split(";")),
            base=args.base,
            trainer=args.trainer,
        ),
    }
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "gpus": gpus(),
        "seconds": args.seconds,
        "quota_seconds": args.quota_seconds,
        "turns_seconds": args.turns_seconds,
    }
    failed = []
    for name in args.sections.split(","):
        started = time.monotonic()
        try:
            res[name] = sections[name](args.seconds)
        except Exception:  # the other sections still run; this one keeps its last good run
            failed.append(name)
            print(f"section {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            continue
        res[name]["section_s"] = round(time.monotonic() - started, 1)
        print(json.dumps({name: res[name]}, indent=1), flush=True)
        if args.json is not None:  # what a run cut short by a time limit has done so far
            args.json.write_text(json.dumps(res, indent=2))
    if failed:
        print(f"sections that failed (tracebacks above): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        spec, seconds, out, ready, delay = sys.argv[2:7]
        worker = infer if spec.startswith("infer") else train
        worker(spec, float(seconds), Path(out), Path(ready), float(delay))
    else:
        sys.exit(main())
