"""Real-GPU checks and benchmarks, run by tests/gpu/run.sh on a machine with an NVIDIA GPU.

Everything runs in one process tree: the daemon (`python -m appliance`), PyTorch workers and
CUDA C programs under LD_PRELOAD=libnvshare.so, and (for the Kubernetes scenario) the fake
API server from tests/kube. Prints one line per check and a summary; writes all numbers as
JSON to $OUT/gpu_results.json (or ./gpu_results.json).
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "ld_hook" / "build" / "libnvshare.so"
PROGRAMS = Path(os.environ.get("NVSHARE_GPU_PROGRAMS", "/tmp/nvshare-programs"))
WORKER = Path(__file__).with_name("torch_worker.py")
GiB = 1 << 30
RESULTS: dict[str, Any] = {}
CHECKS: list[tuple[str, bool, str]] = []
sys.path.insert(0, str(ROOT))

from appliance.cli.client import ControlClient  # noqa: E402
from appliance.core.ledger import CONTEXT_ALLOWANCE_BYTES  # noqa: E402
from appliance.wire import protocol as p  # noqa: E402

MiB = 1 << 20
# An earlier commit's hook, built the same way, for side-by-side numbers (optional).
BEFORE_HOOK = os.environ.get("NVSHARE_GPU_BEFORE_HOOK", "")


def check(name: str, ok: bool, detail: str = "") -> bool:
    CHECKS.append((name, ok, detail))
    print(f"CHECK {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


class Daemon:
    def __init__(
        self,
        policy: str,
        *,
        args: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="nvshare-gpu-"))
        (self.tmp / "policy").mkdir()
        (self.tmp / "policy" / "policy.yaml").write_text(policy + "\nmetrics: {enabled: false}\n")
        self.sock_dir = self.tmp / "run"
        self.log = self.tmp / "daemon.log"
        env = {**os.environ, "NVSHARE_SOCKET_DIR": str(self.sock_dir), **(extra_env or {})}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "appliance",
                "--policy-dir",
                str(self.tmp / "policy"),
                "--debug",
                *(args or []),
            ],
            env=env,
            cwd=ROOT,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while not (self.sock_dir / "scheduler.sock").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("daemon did not start:\n" + self.log.read_text())
            time.sleep(0.05)

    def env(self, hook: Path | str = HOOK, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "NVSHARE_SOCKET_DIR": str(self.sock_dir),
            "LD_PRELOAD": str(hook),
            **extra,
        }

    def ctl(self, message: Any) -> Any:
        with ControlClient(self.sock_dir) as c:
            return c.request(message)

    def status(self) -> dict[str, Any]:
        with ControlClient(self.sock_dir) as c:
            return c.request(p.StatusRequest()).doc  # type: ignore[no-any-return]

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return self.log.read_text()


class Worker:
    """torch_worker.py serve, talking JSON lines over pipes."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "serve"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(
                f"worker died: {self.proc.stderr.read() if self.proc.stderr else ''}"
            )
        return json.loads(out)  # type: ignore[no-any-return]

    def close(self) -> int:
        try:
            self.ask("exit")
        except (RuntimeError, BrokenPipeError):
            pass
        return self.proc.wait(30)


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> str:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout


def nvml_used() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
    finally:
        pynvml.nvmlShutdown()


def overlap_fraction(a: list[list[float]], b: list[list[float]]) -> float:
    total = sum(t1 - t0 for t0, t1 in a) + sum(t1 - t0 for t0, t1 in b)
    shared = 0.0
    for x0, x1 in a:
        for y0, y1 in b:
            shared += max(0.0, min(x1, y1) - max(x0, y0))
    return 2 * shared / total if total else 0.0


# --------------------------------------------------------------------- checks


def gated_torch() -> None:
    d = Daemon("scheduler: {mode: 'on', timeQuantum: 30s}")
    try:
        out = run([sys.executable, str(WORKER), "work", "40"], env=d.env(NVSHARE_DEBUG="1"))
    finally:
        log = d.stop()
    grants = log.count("grant gpu")
    regs = log.count("registered: pid")
    traffic = [ln for ln in log.splitlines() if "registered: pid" in ln or "grant gpu" in ln]
    RESULTS["gated_torch"] = {
        "registrations": regs,
        "grants": grants,
        "worker": json.loads(out),
        "daemon_log": traffic[:6],
    }
    for line in traffic[:3]:
        print(f"   daemon: {line[:160]}")
    check(
        "a. PyTorch runs under the hook with gated launches",
        regs >= 1 and grants >= 1,
        f"{regs} registration(s), {grants} lock grant(s) in the daemon log",
    )


def serialised_pair() -> None:
    results = {}
    for mode in ("on", "off"):
        d = Daemon(f"scheduler: {{mode: '{mode}', timeQuantum: 2s, idleRelease: 200ms}}")
        tmp = d.tmp
        try:
            procs = [
                subprocess.Popen(
                    [sys.executable, str(WORKER), "burn", "8", str(tmp / f"iv{i}.json")],
                    env=d.env(),
                )
                for i in range(2)
            ]
            codes = [pr.wait(120) for pr in procs]
        finally:
            d.stop()
        ivs = [json.loads((tmp / f"iv{i}.json").read_text()) for i in range(2)]
        frac = overlap_fraction(ivs[0], ivs[1])
        results[mode] = {"exit_codes": codes, "overlap": frac, "bursts": [len(x) for x in ivs]}
    RESULTS["pair_overlap"] = results
    on, off = results["on"], results["off"]
    check(
        "b. two PyTorch processes in mode on never overlap, both finish",
        on["exit_codes"] == [0, 0] and on["overlap"] < 0.01,
        f"overlap of busy intervals {on['overlap']:.2%} (mode off, same run: "
        f"{off['overlap']:.2%}); bursts {on['bursts']}",
    )


def multi_gpu() -> None:
    """One lock per GPU: in mode on, jobs on different GPUs run together, jobs on one GPU take
    turns; a process is told about the GPU it really uses (registered by UUID)."""
    import torch

    if torch.cuda.device_count() < 2:
        print("SKIP multi-GPU: one lock per GPU: this machine has one GPU", flush=True)
        return
    results = {}
    for label, devices in (
        ("different GPUs", ("cuda:0", "cuda:1")),
        ("same GPU", ("cuda:1", "cuda:1")),
    ):
        d = Daemon("scheduler: {mode: 'on', timeQuantum: 2s}")
        try:
            procs = [
                subprocess.Popen(
                    [sys.executable, str(WORKER), "burn", "6", str(d.tmp / f"iv{i}.json"), dev],
                    env=d.env(),
                )
                for i, dev in enumerate(devices)
            ]
            seen: set[tuple[int, str]] = set()  # (pid, GPU UUID) registrations
            while any(pr.poll() is None for pr in procs):
                seen |= {(c["pid"], c["gpu"]) for c in d.status()["clients"]}
                time.sleep(0.1)
            codes = [pr.wait(120) for pr in procs]
        finally:
            d.stop()
        ivs = [json.loads((d.tmp / f"iv{i}.json").read_text()) for i in range(2)]
        results[label] = {
            "exit_codes": codes,
            "overlap": overlap_fraction(*ivs),
            "registrations": sorted(seen),
        }
    RESULTS["multi_gpu"] = results
    apart, together = results["different GPUs"], results["same GPU"]
    uuids = {gpu for _, gpu in apart["registrations"]}
    check(
        "multi-GPU: one lock per GPU (mode on)",
        apart["exit_codes"] == [0, 0]
        and together["exit_codes"] == [0, 0]
        and apart["overlap"] > 0.5
        and together["overlap"] < 0.01
        and len(uuids) == 2,
        f"jobs on cuda:0 and cuda:1 overlap {apart['overlap']:.1%}; two jobs on cuda:1 overlap "
        f"{together['overlap']:.2%}; registrations (pid, GPU): different GPUs "
        f"{apart['registrations']}, same GPU {together['registrations']}",
    )


def auto_mode() -> None:
    """Mode auto on a GPU declared smaller in policy: two jobs holding 6 GiB each run together
    when the declared GPU has 16 GiB and take turns when it has 10 GiB."""
    results = {}
    for declared in ("16Gi", "10Gi"):
        d = Daemon(
            "scheduler: {mode: auto, timeQuantum: 2s}\n"
            f"gpus: [{{match: {{}}, memory: {declared}}}]"
        )
        try:
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        "burn",
                        "8",
                        str(d.tmp / f"iv{i}.json"),
                        "cuda",
                        str(6 * GiB),
                    ],
                    env=d.env(),
                )
                for i in range(2)
            ]
            codes = [pr.wait(120) for pr in procs]
        finally:
            d.stop()
        ivs = [json.loads((d.tmp / f"iv{i}.json").read_text()) for i in range(2)]
        results[declared] = {"exit_codes": codes, "overlap": overlap_fraction(*ivs)}
    RESULTS["auto_mode"] = results
    fits, tight = results["16Gi"], results["10Gi"]
    check(
        "auto: concurrent while memory fits a declared GPU, serialised when it does not",
        fits["exit_codes"] == [0, 0]
        and tight["exit_codes"] == [0, 0]
        and fits["overlap"] > 0.5
        and tight["overlap"] < 0.01,
        f"2 x 6Gi on a GPU declared 16Gi: overlap {fits['overlap']:.1%}; declared 10Gi: "
        f"{tight['overlap']:.2%}",
    )


def launch_bound() -> None:
    prog = str(PROGRAMS)
    d = Daemon("scheduler: {mode: 'on', timeQuantum: 30s}")
    native, hooked, before = [], [], []
    variants: list[tuple[list[float], dict[str, str] | None]] = [
        (native, None),
        (hooked, d.env()),
    ]
    if BEFORE_HOOK:
        variants.append((before, d.env(hook=BEFORE_HOOK)))
    order = random.Random(9)
    try:
        for _ in range(11):  # alternate in a shuffled order: drift hits every variant alike
            for results, env in order.sample(variants, len(variants)):
                results.append(float(run([prog, "launch", "20000"], env=env).split()[1]))
    finally:
        log = d.stop()
    n, h = statistics.median(native), statistics.median(hooked)
    RESULTS["launch_bound"] = {
        "native_us": native,
        "hooked_us": hooked,
        "before_hook_us": before,
        "ratio": h / n,
        "grants": log.count("grant gpu"),
    }
    then = f"; the earlier hook {statistics.median(before):.3f} us" if before else ""
    check(
        "c. launch-bound loop, hooked vs native (benchmark)",
        log.count("grant gpu") >= 1,
        f"native {n:.3f} us, hooked {h:.3f} us per launch, ratio {h / n:.3f}x (target <= 1.01x)"
        + then,
    )


def torch_memory() -> None:
    d = Daemon("defaults: {memoryLimit: 1Gi}")
    base = nvml_used()
    summary: dict[str, Any] = {}
    try:
        for label, extra in (
            ("default", {}),
            ("expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
            ("cudaMallocAsync", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
        ):
            w = Worker(d.env(**extra))
            info = w.ask("info")
            nvml = w.ask("nvml")
            check(
                f"memory: NVML in the hooked process agrees with the limit ({label})",
                nvml.get("total") == GiB and nvml.get("free", -1) + nvml.get("used", -1) == GiB,
                json.dumps(nvml),
            )
            big = w.ask(f"alloc {2 * GiB}")
            small = w.ask(f"alloc {512 << 20}")
            summary[label] = {"info": info, "2GiB": big["result"], "512MiB": small["result"]}
            check(
                f"memory: PyTorch ({label} allocator) stops at 1Gi with OutOfMemoryError",
                big["result"] == "oom" and small["result"] == "ok",
                f"2Gi -> {big['result']}, 512Mi -> {small['result']}",
            )
            check(
                f"memory: torch.cuda.mem_get_info shows the limit ({label})",
                info["total"] == GiB and 0 <= info["free"] <= GiB,
                f"free {info['free']}, total {info['total']}",
            )
            if label == "default":
                pid = w.proc.pid
                t0 = time.monotonic()
                reply = d.ctl(p.LimitSet(pid=pid, flags=p.LIMIT_SET_HAS_MEM, mem_limit=4 * GiB))
                grown = w.ask(f"alloc {2 * GiB}")
                dt = time.monotonic() - t0
                summary["raise_seconds"] = dt
                check(
                    "memory: limit raised 1Gi -> 4Gi live, the 2Gi tensor then fits",
                    reply.status == p.Status.OK and grown["result"] == "ok" and dt < 1.0,
                    f"{grown['result']} {dt * 1000:.0f} ms after `limit set`",
                )
                outcomes = []
                for i in range(20):
                    limit = GiB if i % 2 == 0 else 4 * GiB
                    d.ctl(p.LimitSet(pid=pid, flags=p.LIMIT_SET_HAS_MEM, mem_limit=limit))
                    got = w.ask(f"alloc {2 * GiB}")["result"]
                    outcomes.append((limit // GiB, got))
                right = all((got == "oom") == (lim == 1) for lim, got in outcomes)
                summary["toggles"] = outcomes
                check(
                    "memory: 20 live toggles 1Gi/4Gi, every allocation outcome right",
                    right,
                    " ".join(f"{lim}G:{got}" for lim, got in outcomes),
                )
                d.ctl(p.LimitSet(pid=pid, flags=p.LIMIT_SET_CLEAR_MEM))
                cleared = w.ask(f"alloc {2 * GiB}")["result"]
                check(
                    "memory: `limit clear` restores the policy value (1Gi)",
                    cleared == "oom",
                    f"2Gi after clear -> {cleared}",
                )
            w.close()
        time.sleep(0.5)
        after = nvml_used()
        summary["nvml_used_baseline"], summary["nvml_used_after"] = base, after
        check(
            "memory: NVML used memory back at baseline after the workers exit",
            abs(after - base) < 64 << 20,
            f"baseline {base >> 20} MiB, after {after >> 20} MiB",
        )
        prog = str(PROGRAMS)
        over = run([prog, "alloc_paths", str(2 * GiB)], env=d.env())
        under = run([prog, "alloc_paths", str(256 << 20)], env=d.env())
        summary["alloc_paths_2GiB"], summary["alloc_paths_256MiB"] = over, under
        paths = ("cudaMallocAsync", "cudaMallocFromPoolAsync", "cudaMallocArray", "cudaMalloc")
        refused = all(f"{x} {2 * GiB} oom" in over for x in paths)
        allowed = all(f"{x} {256 << 20} ok" in under for x in paths)
        check(
            "memory: CUDA C async, pool and array allocations stop at the limit",
            refused and allowed,
            over.replace("\n", "; ") + " | " + under.replace("\n", "; "),
        )
    finally:
        d.stop()
    RESULTS["torch_memory"] = summary


# The processes name their pod (they run in none); the policy trusts this user's claims.
VIEW_POLICY = f"""scheduler: {{mode: 'off'}}
rules:
  - {{name: team, match: {{namespace: team}}, memoryLimit: 1Gi}}
trust: {{podClaimUids: [{os.getuid()}]}}
"""


def smi(env: dict[str, str], query: str, kind: str = "gpu") -> list[list[int]]:
    """nvidia-smi --query-<kind>=<query> as rows of integers (MiB for memory)."""
    out = run(["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"], env=env)
    return [[int(x) for x in line.split(",")] for line in out.splitlines() if line.strip()]


def shown_gpu(env: dict[str, str], *args: str) -> dict[str, Any]:
    """tests/e2e/shown_gpu.py: the GPU through pynvml (and the CUDA driver with --cuda)."""
    out = run([sys.executable, str(ROOT / "tests" / "e2e" / "shown_gpu.py"), *args], env=env)
    return json.loads(out.splitlines()[-1])  # type: ignore[no-any-return]


def gpu_view() -> None:
    """A pod with a 1Gi limit from policy: real nvidia-smi, pynvml with and without CUDA and
    PyTorch all show a 1Gi GPU, the pod's use and its processes; a host process with no limit
    sees the real GPU."""
    sys.path.insert(0, str(ROOT / "tests" / "kube"))
    from fakeapi import FakeApiServer  # type: ignore[import-not-found]

    api_server = FakeApiServer().start()
    api_server.add_node("gpu-node")
    api_server.add_pod("view", namespace="team", node="gpu-node")
    d = Daemon(VIEW_POLICY, args=["--node-name", "gpu-node", "--kube-api", api_server.url])
    pod = d.env(NVSHARE_POD_NAMESPACE="team", NVSHARE_POD_NAME="view")
    summary: dict[str, Any] = {}
    try:
        time.sleep(1.0)  # the first list
        w = Worker(pod)
        summary["hold"] = w.ask(f"hold {256 * MiB}")
        time.sleep(0.5)  # the worker's usage report (a service tick)
        torch_info = w.ask("info")
        no_cuda, with_cuda = shown_gpu(pod), shown_gpu(pod, "--cuda", str(64 * MiB))
        smi_memory = smi(pod, "memory.total,memory.used,memory.free")
        smi_apps = smi(pod, "pid,used_memory", "compute-apps")
        summary["nvidia_smi_screen"] = run(["nvidia-smi"], env=pod)
        host_smi = smi(d.env(), "memory.total,memory.used")
        host_nvml = shown_gpu(d.env())
        real_total = smi(os.environ.copy(), "memory.total")[0][0]
        summary |= {
            "torch": torch_info,
            "pynvml_without_cuda": no_cuda,
            "pynvml_with_cuda": with_cuda,
            "nvidia_smi_memory": smi_memory,
            "nvidia_smi_compute_apps": smi_apps,
            "host_nvidia_smi": host_smi,
            "host_pynvml": host_nvml,
            "real_total_mib": real_total,
            "worker_pid": w.proc.pid,
        }
        pod_used = 256 * MiB
        check(
            "view: nvidia-smi in the pod shows a 1024 MiB GPU, the pod's 256 MiB used",
            smi_memory == [[1024, 256, 768]],
            f"total,used,free MiB {smi_memory}",
        )
        # nvidia-smi reads its process list through NVML's private export table, which the hook
        # cannot interpose: the PID is right, the usage is the driver's (context included).
        check(
            "view: nvidia-smi in the pod lists the pod's process by the PID it knows",
            [pid for pid, _ in smi_apps] == [w.proc.pid],
            f"pid,MiB {smi_apps} (worker pid {w.proc.pid}; usage from NVML's private table)",
        )
        check(
            "view: pynvml without CUDA agrees (memory info v1 and v2, process lists v1/v2/v3)",
            no_cuda["v1"] == [GiB, pod_used, GiB - pod_used]
            and no_cuda["v2"] == [GiB, pod_used, GiB - pod_used, 0]
            and all(
                no_cuda[k] == [[w.proc.pid, pod_used]]
                for k in ("compute_v1", "compute_v2", "compute_v3")
            ),
            json.dumps(no_cuda),
        )
        both = pod_used + 64 * MiB
        check(
            "view: pynvml and the driver with CUDA agree (itself listed first)",
            with_cuda["v1"] == [GiB, both, GiB - both]
            and with_cuda["mem_get_info"] == [GiB - both, GiB]
            and with_cuda["device_total"] == GiB
            and with_cuda["compute_v3"][1:] == [[w.proc.pid, pod_used]],
            json.dumps(with_cuda),
        )
        check(
            "view: torch.cuda.mem_get_info and get_device_properties agree",
            torch_info == {"free": GiB - pod_used, "total": GiB, "device_total": GiB},
            json.dumps(torch_info),
        )
        check(
            "view: a host process with no limit sees the real GPU and every process",
            host_smi[0][0] == real_total
            and host_nvml["v1"][0] // MiB == real_total
            and w.proc.pid in [pid for pid, _ in host_nvml["compute_v3"]],
            f"nvidia-smi {host_smi}, pynvml {host_nvml['v1']}, {host_nvml['compute_v3']}",
        )
        check("view: the worker exits cleanly", w.close() == 0, "")
    finally:
        d.stop()
        api_server.stop()
    RESULTS["view"] = summary


def managed_backing() -> None:
    # Small allocations only: the shared GPU must never be oversubscribed for real.
    d = Daemon("memory: {backing: managed}\ndefaults: {memoryLimit: 1Gi}")
    try:
        w = Worker(d.env())
        kind = w.ask(f"ismanaged {256 << 20}")
        big = w.ask(f"alloc {2 * GiB}")["result"]
        small = w.ask(f"alloc {512 << 20}")["result"]
        code = w.close()
    finally:
        d.stop()
    RESULTS["managed"] = {"ismanaged": kind, "2GiB": big, "512MiB": small, "exit": code}
    check(
        "memory: backing managed serves PyTorch's cudaMalloc with managed memory, limit kept",
        kind.get("managed") is True and big == "oom" and small == "ok" and code == 0,
        f"tensor managed={kind.get('managed')} ({kind.get('result')}); 2Gi -> {big}, "
        f"512Mi -> {small}",
    )


def quota_accuracy(names: list[str] | None) -> None:
    """Compute quotas at the shipped defaults: each client's throughput relative to the same
    work alone and unlimited (bench/quota_accuracy_gpu.py), within one point of its limit."""
    sys.path.insert(0, str(ROOT / "bench"))
    from quota_accuracy_gpu import markdown, table

    rows = table(names, windows=16)
    print(markdown(rows), flush=True)
    RESULTS["quota"] = [vars(r) for r in rows]
    off = [
        f"{r.scenario} [{r.limit}]: {r.share * 100:.1f}"
        for r in rows
        if abs(r.share * 100 - r.limit) > 1
    ]
    check(
        f"quota: {len(rows)} shares within one point of their limit (shipped defaults, 16 windows)",
        not off,
        "outside: " + ", ".join(off) if off else ", ".join(f"{r.share * 100:.1f}" for r in rows),
    )


def fail_soft() -> None:
    """kill -9 of the daemon while PyTorch holds the lock: the job runs to completion."""
    d = Daemon("scheduler: {mode: 'on'}")
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "rate", "6"],
        env=d.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not any(c["state"] == "holding" for c in d.status()["clients"]):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the PyTorch job never took the lock")
        time.sleep(0.05)
    d.proc.kill()  # while the job holds the lock and computes
    d.proc.wait()
    out, err = proc.communicate(timeout=120)
    notices = [ln for ln in err.splitlines() if ln.startswith("nvshare: ")]
    RESULTS["fail_soft"] = {"exit": proc.returncode, "stderr_notices": notices}
    check(
        "fail-soft: kill -9 of the daemon leaves the PyTorch job running to completion",
        proc.returncode == 0
        and len(notices) == 1
        and "lost the connection" in notices[0]
        and "matmuls" in out,
        f"exit {proc.returncode}; stderr: {notices}",
    )


def alloc_bench() -> None:
    prog = str(PROGRAMS)
    d = Daemon("scheduler: {mode: 'on'}")
    try:
        pairs_native = float(run([prog, "malloc", "20000"]).split()[1])
        pairs_hooked = float(run([prog, "malloc", "20000"], env=d.env()).split()[1])
        free_native = float(run([prog, "free_live", "4000"]).split()[1])
        free_hooked = float(run([prog, "free_live", "4000"], env=d.env()).split()[1])
    finally:
        d.stop()
    RESULTS["alloc_bench"] = {
        "malloc_free_pair_us": [pairs_native, pairs_hooked],
        "free_4000_live_us": [free_native, free_hooked],
    }
    check(
        "bench: 2 MiB cudaMalloc/cudaFree pair",
        True,
        f"native {pairs_native:.2f} us, hooked {pairs_hooked:.2f} us, "
        f"ratio {pairs_hooked / pairs_native:.2f}x",
    )
    check(
        "bench: cudaFree with 4,000 live allocations",
        True,
        f"native {free_native:.2f} us, hooked {free_hooked:.2f} us, "
        f"ratio {free_hooked / free_native:.2f}x",
    )


def makespan(steps: int) -> None:
    """Two compute-bound jobs: GPU makespan (first job's first GPU work to last job's end, so
    Python and PyTorch start-up are left out) and each job's own GPU work time."""

    def pair(policy: str) -> tuple[float, list[float]]:
        d = Daemon(policy)
        try:
            procs = [
                subprocess.Popen(
                    [sys.executable, str(WORKER), "work", str(steps)],
                    env=d.env(),
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for _ in range(2)
            ]
            docs = [json.loads(pr.communicate(timeout=400)[0]) for pr in procs]
        finally:
            d.stop()
        span = max(x["end"] for x in docs) - min(x["begin"] for x in docs)
        return span, [x["seconds"] for x in docs]

    d = Daemon("scheduler: {mode: 'on'}")
    try:
        solo = json.loads(run([sys.executable, str(WORKER), "work", str(steps)], env=d.env()))
    finally:
        d.stop()
    free_ms, free_jobs = pair("scheduler: {mode: 'off'}")
    on_ms, on_jobs = pair("scheduler: {mode: 'on', timeQuantum: 30s}")
    RESULTS["makespan"] = {
        "steps": steps,
        "solo_s": solo["seconds"],
        "free_running_s": free_ms,
        "free_jobs_s": free_jobs,
        "mode_on_s": on_ms,
        "mode_on_jobs_s": on_jobs,
    }
    check(
        "bench: two compute-bound jobs, GPU makespan mode on vs free-running",
        True,
        f"solo {solo['seconds']:.2f} s; free-running {free_ms:.2f} s (jobs "
        f"{free_jobs[0]:.2f}, {free_jobs[1]:.2f}); mode on TQ30 {on_ms:.2f} s (jobs "
        f"{on_jobs[0]:.2f}, {on_jobs[1]:.2f}); ratio {on_ms / free_ms:.3f}",
    )


def program(args: list[str], env: dict[str, str]) -> dict[str, str]:
    """A programs.cu check: its "key value..." lines as a dict."""
    out = run([str(PROGRAMS), *args], env=env)
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def held_memory() -> None:
    """NCCL's VMM pattern, RMM's pool, a captured graph's memory: all counted under 1Gi."""
    d = Daemon("defaults: {memoryLimit: 1Gi}")
    try:
        vmm = program(["vmm", str(GiB)], d.env())
        pool = program(["pool", str(768 * MiB)], d.env())
        graph = program(["graph_mem", str(640 * MiB)], d.env())
        native_vmm = program(["vmm", str(GiB)], {**os.environ, "LD_PRELOAD": ""})
    finally:
        d.stop()
    RESULTS["held_memory"] = {"vmm": vmm, "vmm_native": native_vmm, "pool": pool, "graph": graph}
    bound = GiB + CONTEXT_ALLOWANCE_BYTES
    check(
        "memory: VMM handles released while still mapped stay counted (NCCL, CUDA samples)",
        vmm["vmm_mapped"].startswith("4 ")
        and vmm["vmm_refusal"] == "2"
        and vmm["vmm_created_while_retained"] == "3"
        and vmm["vmm_created_after_release"] == "1"
        and int(vmm["vmm_nvml_used"]) <= bound,
        f"hooked: {vmm}; native (no hook): mapped {native_vmm.get('vmm_mapped')}, NVML "
        f"{int(native_vmm.get('vmm_nvml_used', 0)) >> 20} MiB",
    )
    check(
        "memory: a pool with release threshold max is charged for what it keeps (RMM, TensorRT)",
        pool["pool_first"] == "ok"
        and pool["pool_then_malloc"] == "oom"
        and pool["pool_reuse"] == "ok"
        and pool["pool_trimmed_then_malloc"] == "ok"
        and int(pool["pool_nvml_used"]) <= bound,
        json.dumps(pool),
    )
    check(
        "memory: a graph's memory counts from its launch, not its capture",
        int(graph["graph_free_after_capture"]) == GiB
        and int(graph["graph_free_after_launch"]) <= GiB - 640 * MiB
        and graph["graph_then_malloc"] == "oom"
        and graph["graph_trimmed_then_malloc"] == "ok"
        and int(graph["graph_nvml_used"]) <= bound,
        json.dumps(graph),
    )


def worker_report(kind: str, seconds: str, env: dict[str, str]) -> dict[str, Any]:
    """A torch_worker run's JSON line; a run that dies is reported, not raised."""
    try:
        out = run([sys.executable, str(WORKER), kind, seconds], env=env)
        return dict(json.loads(out.splitlines()[-1]))
    except (RuntimeError, ValueError, IndexError) as exc:
        return {"failures": -1, "died": str(exc)[-500:]}


def graph_memory() -> None:
    """Graph memory inside the limit before the driver reserves it (issue 26), limit 1Gi: a 2 GiB
    captured cudaMallocAsync refused at instantiate/upload with nothing reserved (natively it
    runs), a 512 MiB one admitted and charged once over four launches, and PyTorch's CUDA graphs
    (torch.cuda.graph, torch.compile reduce-overhead; also with the cudaMallocAsync backend,
    whose graphs carry memory nodes) unaffected below the limit."""
    d = Daemon("defaults: {memoryLimit: 1Gi}")
    try:
        over = program(["graph_admit", str(2 * GiB)], d.env())
        within = program(["graph_admit", str(512 * MiB)], d.env())
        torch_runs = {
            f"{kind}{suffix}": worker_report(kind, "5", d.env(**extra))
            for kind in ("graphs", "compiled")
            for suffix, extra in (
                ("", {}),
                ("_async", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
            )
        }
    finally:
        d.stop()
    native = program(["graph_admit", str(2 * GiB)], {**os.environ, "LD_PRELOAD": ""})
    async_env = {
        **os.environ,
        "LD_PRELOAD": "",
        "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync",
    }
    native_torch = {  # whether PyTorch itself manages these, without the hook
        kind: worker_report(kind, "5", async_env) for kind in ("graphs", "compiled")
    }
    RESULTS["graph_memory"] = {
        "over": over,
        "within": within,
        "native_over": native,
        **torch_runs,
        "native_async": native_torch,
    }
    check(
        "graph memory: a 2 GiB graph allocation under 1 GiB is refused before it is reserved",
        over["graph_instantiate_upload"] == "oom"
        and over["graph_instantiate"] == "oom"
        and over["graph_launches_ok"] == "0"
        and over["graph_reserved"] == "0"
        and int(over["graph_nvml_used"]) < GiB
        and native["graph_instantiate"] == "ok"
        and native["graph_launches_ok"] == "4",
        f"hooked: {json.dumps(over)}; native: instantiate {native.get('graph_instantiate')}, "
        f"{native.get('graph_launches_ok')} launches, reserved {native.get('graph_reserved')}",
    )
    check(
        "graph memory: a 512 MiB graph allocation is admitted and charged once over 4 launches",
        within["graph_instantiate_upload"] == "ok"
        and within["graph_instantiate"] == "ok"
        and within["graph_upload"] == "ok"
        and within["graph_launches_ok"] == "4"
        and int(within["graph_reserved"]) >= 512 * MiB
        and int(within["graph_free"]) <= GiB - 512 * MiB
        and int(within["graph_free"]) >= GiB - 2 * 512 * MiB
        and within["graph_reserved_after_trim"] == "0",
        json.dumps(within),
    )
    for key, unit in (
        ("graphs", "captures"),
        ("graphs_async", "captures"),
        ("compiled", "calls"),
        ("compiled_async", "calls"),
    ):
        r = torch_runs[key]
        natively = (
            native_torch.get(key.removesuffix("_async"), {}) if key.endswith("_async") else {}
        )
        without = f"; without the hook: {json.dumps(natively)[:300]}" if natively else ""
        if r.get("failures") == -1 and natively.get("failures") == -1:
            # PyTorch cannot run this with the backend at all: the hook has nothing to show
            print(f"SKIP graph memory: PyTorch {key}: dies without the hook too{without}")
            continue
        check(
            f"graph memory: PyTorch {key} below the limit: no failure the hook causes",
            (r.get(unit, 0) > 0 and r.get("failures") == 0)
            or 0 < r.get("failures", 0) <= natively.get("failures", 0),
            json.dumps(r)[:500] + without,
        )


def two_gpu() -> None:
    """Memory and the lock follow the stream's GPU, not the current context's."""
    import pynvml
    import torch

    if torch.cuda.device_count() < 2:
        print("SKIP two-GPU attribution: this machine has one GPU", flush=True)
        return
    pynvml.nvmlInit()
    raw = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in (0, 1)]
    uuids = [u.decode() if isinstance(u, bytes) else str(u) for u in raw]
    d = Daemon("scheduler: {mode: 'on', timeQuantum: 30s}\ndefaults: {memoryLimit: 1Gi}")
    try:
        out = program(["two_gpu", str(768 * MiB)], d.env())
    finally:
        log = d.stop()
    grants = [ln.split("grant gpu ")[-1] for ln in log.splitlines() if "grant gpu" in ln]
    RESULTS["two_gpu"] = {"program": out, "grants": grants, "uuids": uuids}
    check(
        "two GPUs: allocations and launches on a device-1 stream count on device 1",
        out.get("two_gpu_first_on_1") == "ok"
        and out.get("two_gpu_then_on_0") == "ok"
        and out.get("two_gpu_second_on_1") == "oom"
        and bool(grants)
        and all(g.startswith(uuids[1]) for g in grants),
        f"{out}; lock grants {grants} (device 0 is {uuids[0]}, device 1 {uuids[1]})",
    )


class NvmlWatch:
    """Samples what NVML shows each of `pids` holding, every 100 ms, keeping the maximum."""

    def __init__(self) -> None:
        import threading

        self.pids: set[int] = set()
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        while not self._stop.wait(0.1):
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in self.pids and proc.usedGpuMemory is not None:
                    self.peak[proc.pid] = max(self.peak.get(proc.pid, 0), proc.usedGpuMemory)

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def against_a_competitor(job: list[str], seconds: float, hook: Path | str = HOOK) -> dict[str, Any]:
    """`job` while a compute-bound PyTorch process competes, mode on, TQ 1 s, limit 2Gi."""
    d = Daemon("scheduler: {mode: 'on', timeQuantum: 1s}\ndefaults: {memoryLimit: 2Gi}")
    watch = NvmlWatch()
    try:
        burn = subprocess.Popen(
            [sys.executable, str(WORKER), "burn", str(seconds), str(d.tmp / "burn.json")],
            env=d.env(hook=hook),
        )
        proc = subprocess.Popen(job, env=d.env(hook=hook), stdout=subprocess.PIPE, text=True)
        watch.pids |= {burn.pid, proc.pid}
        out, _ = proc.communicate(timeout=420)
        burn.wait(120)
    finally:
        peak = watch.stop()
        log = d.stop()
    lines = [ln for ln in out.splitlines() if ln.strip()]
    try:
        doc: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, ValueError):  # a C program's "key value" line
        fields = lines[-1].split() if lines else []
        doc = dict(zip(fields[::2], fields[1::2], strict=False))
    doc.update(
        exit=proc.returncode,
        drops=log.count("drop client"),
        nvml_peak_mib={str(k): v >> 20 for k, v in peak.items()},
    )
    return doc


def captures_under_drops() -> None:
    """Graph captures while the lock moves every second: none may fail."""
    bound_mib = (2 * GiB + CONTEXT_ALLOWANCE_BYTES) >> 20
    runs = {
        "cuda_c": against_a_competitor([str(PROGRAMS), "capture_loop", "20"], 22),
        "torch_graph": against_a_competitor([sys.executable, str(WORKER), "graphs", "20"], 30),
        "torch_compile": against_a_competitor([sys.executable, str(WORKER), "compiled", "15"], 75),
    }
    if BEFORE_HOOK:
        runs["cuda_c_before"] = against_a_competitor(
            [str(PROGRAMS), "capture_loop", "15"], 17, hook=BEFORE_HOOK
        )
    d = Daemon("defaults: {memoryLimit: 2Gi}")
    try:
        runs["context_overhead"] = json.loads(
            run([sys.executable, str(WORKER), "overhead"], env=d.env())
        )
    finally:
        d.stop()
    RESULTS["captures_under_drops"] = runs
    c = runs["cuda_c"]
    check(
        "capture: CUDA C graph captures (global mode) while another job competes, TQ 1 s",
        c["exit"] == 0
        and c.get("failures") == "0"
        and int(c.get("captures", 0)) > 0
        and c["drops"] > 0,
        f"{c.get('captures')} captures, {c.get('failures')} failures, {c['drops']} drops"
        + (
            f"; the earlier hook: {runs['cuda_c_before'].get('failures')} failures of "
            f"{runs['cuda_c_before'].get('captures')} ({runs['cuda_c_before'].get('first_error')})"
            if "cuda_c_before" in runs
            else ""
        ),
    )
    for key, label, unit in (
        ("torch_graph", "repeated torch.cuda.graph captures", "captures"),
        ("torch_compile", 'torch.compile(mode="reduce-overhead")', "calls"),
    ):
        r = runs[key]
        check(
            f"capture: PyTorch {label} while another job competes, TQ 1 s: 0 failures",
            r["exit"] == 0 and r.get("failures") == 0 and r.get(unit, 0) > 0 and r["drops"] > 0,
            f"{r.get(unit)} {unit}, {r.get('failures')} failures {r.get('first_error')}, "
            f"{r['drops']} drops"
            + (f", compiled in {r['compile_seconds']:.1f} s" if "compile_seconds" in r else ""),
        )
    peaks = {
        f"{key}:{pid}": mib
        for key in ("cuda_c", "torch_graph", "torch_compile")
        for pid, mib in runs[key]["nvml_peak_mib"].items()
    }
    over = runs["context_overhead"]
    check(
        "memory: NVML per-process usage never above the limit plus the context allowance",
        bool(peaks) and max(peaks.values()) <= bound_mib,
        f"peaks (MiB) {peaks}; limit 2048 MiB + allowance {CONTEXT_ALLOWANCE_BYTES >> 20} MiB = "
        f"{bound_mib} MiB; a PyTorch process with one tensor: NVML "
        f"{(over.get('nvml_used') or 0) >> 20} MiB",
    )


def kube_annotations() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "kube"))
    from fakeapi import FakeApiServer  # type: ignore[import-not-found]
    from kubernetes import client

    api_server = FakeApiServer().start()
    node = "gpu-node"
    api_server.add_node(node)
    api_server.add_pod(
        "pod-a", namespace="team", node=node, annotations={"nvshare.com/gpu-memory-limit": "1Gi"}
    )
    api_server.add_pod(
        "pod-b", namespace="team", node=node, annotations={"nvshare.com/gpu-memory-limit": "3Gi"}
    )
    # The workers name their pods (they run in none); the policy trusts this user's claims.
    d = Daemon(
        f"scheduler: {{mode: 'off'}}\ntrust: {{podClaimUids: [{os.getuid()}]}}",
        args=["--node-name", node, "--kube-api", api_server.url],
    )
    summary: dict[str, Any] = {}
    try:
        time.sleep(1.0)  # the first list
        a = Worker(d.env(NVSHARE_POD_NAMESPACE="team", NVSHARE_POD_NAME="pod-a"))
        b = Worker(d.env(NVSHARE_POD_NAMESPACE="team", NVSHARE_POD_NAME="pod-b"))
        ra, rb = a.ask(f"alloc {2 * GiB}")["result"], b.ask(f"alloc {2 * GiB}")["result"]
        check(
            "kube: pod-a at 1Gi fails 2Gi while pod-b at 3Gi succeeds",
            ra == "oom" and rb == "ok",
            f"pod-a {ra}, pod-b {rb}",
        )
        cfg = client.Configuration()
        cfg.host = api_server.url
        core = client.CoreV1Api(client.ApiClient(cfg))

        def annotate(value: str) -> float:
            t0 = time.monotonic()
            core.patch_namespaced_pod(
                "pod-a",
                "team",
                {"metadata": {"annotations": {"nvshare.com/gpu-memory-limit": value}}},
            )
            return t0

        t0 = annotate("4Gi")
        got, deadline = "oom", time.monotonic() + 5
        while got != "ok" and time.monotonic() < deadline:
            got = a.ask(f"alloc {2 * GiB}")["result"]
        dt = time.monotonic() - t0
        check(
            "kube: pod-a resized 1Gi -> 4Gi by annotation, no restart, then succeeds",
            got == "ok" and dt < 1.0,
            f"{got} {dt * 1000:.0f} ms after the API write",
        )
        outcomes = []
        for i in range(20):
            value = "1Gi" if i % 2 == 0 else "4Gi"
            annotate(value)
            want = "oom" if value == "1Gi" else "ok"
            got, deadline = "", time.monotonic() + 2
            while got != want and time.monotonic() < deadline:
                got = a.ask(f"alloc {2 * GiB}")["result"]
            outcomes.append((value, got))
        check(
            "kube: 20 annotation toggles 1Gi/4Gi, every outcome right",
            all((v == "1Gi") == (g == "oom") for v, g in outcomes),
            " ".join(f"{v}:{g}" for v, g in outcomes),
        )
        summary["toggles"] = outcomes
        st = d.status()
        summary["status_clients"] = st["clients"]
        codes = [a.close(), b.close()]
        check("kube: no crash", codes == [0, 0], f"worker exit codes {codes}")
    finally:
        d.stop()
        api_server.stop()
    RESULTS["kube"] = summary


HOLDER = """
import sys, torch
held = []  # every GPU of the node: the extender accepts a node where any one has room
for i in range(torch.cuda.device_count()):
    free, total = torch.cuda.mem_get_info(i)
    held.append(torch.empty(free - int(sys.argv[1]), dtype=torch.uint8, device=f"cuda:{i}"))
torch.cuda.synchronize()
print(held[0].numel(), flush=True)
sys.stdin.readline()
"""


def realtime_extender() -> None:
    """A process outside the hook fills the GPU; the node publishes; the extender filters."""
    sys.path.insert(0, str(ROOT / "tests" / "kube"))
    import http.client
    import socket

    import manifests  # type: ignore[import-not-found]
    from fakeapi import FakeApiServer  # type: ignore[import-not-found]

    from appliance.placement.status import ANNOTATION, decode

    api = FakeApiServer().start()
    api.load_rbac(list(manifests.rendered()))  # each component under its deploy/ role
    node = "gpu-node"
    api.add_node(node)
    tmp = Path(tempfile.mkdtemp(prefix="nvshare-rt-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def kubeconfig(account: str) -> str:
        return str(
            api.write_kubeconfig(
                tmp / f"{account}.kubeconfig", namespace="nvshare-system", service_account=account
            )
        )

    d = Daemon(
        "scheduler: {mode: 'off'}\n"
        "realtimeCheck: {nodeStatus: {minInterval: 1s, refreshInterval: 30s}}",
        args=["--node-name", node],
        extra_env={"KUBECONFIG": kubeconfig("nvshare-node")},
    )
    (tmp / "extender-policy").mkdir()
    (tmp / "extender-policy" / "policy.yaml").write_text("realtimeCheck: {mode: strict}\n")
    ext_log = tmp / "extender.log"
    extender = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "appliance",
            "extender",
            f"--port={port}",
            "--host=127.0.0.1",
            f"--policy-dir={tmp / 'extender-policy'}",
        ],
        env={**os.environ, "KUBECONFIG": kubeconfig("nvshare-extender")},
        cwd=ROOT,
        stdout=ext_log.open("w"),
        stderr=subprocess.STDOUT,
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def published() -> Any:
        text = (api.get("nodes", node)["metadata"].get("annotations") or {}).get(ANNOTATION)
        return None if text is None else decode(text)

    def verdict(need: str) -> dict[str, Any]:
        pod = {
            "metadata": {"name": "train", "namespace": "team", "uid": "u1"},
            "spec": {
                "containers": [{"name": "m", "resources": {"limits": {"nvshare.com/gpu": "1"}}}]
            },
        }
        pod["metadata"]["annotations"] = {"nvshare.com/gpu-memory-limit": need}
        body = json.dumps({"Pod": pod, "Nodes": None, "NodeNames": [node]})
        conn.request("POST", "/filter", body, {"Content-Type": "application/json"})
        return dict(json.loads(conn.getresponse().read()))

    def wait(pred: Callable[[], bool], limit: float = 30.0) -> float:
        t0 = time.monotonic()
        while not pred():
            if time.monotonic() - t0 > limit:
                return float("inf")
            time.sleep(0.02)
        return time.monotonic() - t0

    def ready() -> bool:
        try:
            conn.request("GET", "/readyz")
            return conn.getresponse().read() == b"ok\n"
        except OSError:
            conn.close()
            return False

    summary: dict[str, Any] = {}
    holder: subprocess.Popen[str] | None = None
    try:
        wait(lambda: published() is not None and ready())
        idle = published()
        assert idle is not None, "the node never published"
        summary["idle"] = {
            "used_mib": idle.gpus[0].memory_used >> 20,
            "total_mib": idle.gpus[0].memory_total >> 20,
        }
        check("realtime: idle node accepted for 8Gi", verdict("8Gi")["NodeNames"] == [node], "")
        patches_before = sum(1 for m, *_ in api.requests if m == "PATCH")
        # outside the hook, and on every GPU the node publishes (NVML sees them all)
        env = {
            k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")
        }
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(4 * GiB)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None and holder.stdin is not None
        held = int(holder.stdout.readline())
        t_held = time.monotonic()
        seen = wait(
            lambda: (
                (st := published()) is not None
                and st.gpus[0].memory_used >= idle.gpus[0].memory_used + held * 0.9
            )
        )
        refused = wait(lambda: verdict("8Gi")["NodeNames"] == [])
        during = verdict("8Gi")
        small = verdict("1Gi")
        busy = (api.get("nodes", node)["metadata"].get("annotations") or {}).get(ANNOTATION)
        summary["held_mib"] = held >> 20
        summary["publish_latency_s"] = round(seen, 3)
        summary["refused_after_publish_s"] = round(refused, 3)
        summary["busy_status"] = json.loads(busy) if busy else None
        summary["failed_reason"] = during["FailedNodes"].get(node)
        check(
            "realtime: the node publishes a process outside the hook within seconds",
            seen < 5.0,
            f"{held >> 20} MiB held by a plain cudaMalloc; on the Node after {seen:.2f} s",
        )
        check(
            "realtime: strict extender refuses the node for 8Gi, accepts 1Gi",
            during["NodeNames"] == [] and small["NodeNames"] == [node],
            f"8Gi refused {refused:.2f} s after publishing: {during['FailedNodes'].get(node)}",
        )
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(30)
        t_exit = time.monotonic()
        freed = wait(
            lambda: (
                (st := published()) is not None
                and st.gpus[0].memory_used < idle.gpus[0].memory_used + GiB
            )
        )
        accepted = wait(lambda: verdict("8Gi")["NodeNames"] == [node])
        summary["freed_publish_s"] = round(freed, 3)
        summary["accepted_after_exit_s"] = round(time.monotonic() - t_exit, 3)
        check(
            "realtime: accepted again once the process exits",
            freed < 5.0 and accepted < 5.0,
            f"freed on the Node {freed:.2f} s after exit; accepted {accepted:.2f} s later",
        )
        duration = time.monotonic() - t_held
        writes = sum(1 for m, *_ in api.requests if m == "PATCH") - patches_before
        summary["writes"] = {"count": writes, "seconds": round(duration, 1)}
        log = ext_log.read_text()
        summary["extender_log_failed_line"] = next(
            (x for x in log.splitlines() if "Real-time check failed" in x), None
        )
        check("realtime: extender ran without a traceback", "Traceback" not in log, "")
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        extender.terminate()
        extender.wait(10)
        conn.close()
        d.stop()
        api.stop()
    RESULTS["realtime"] = summary


def main() -> int:
    steps = int(os.environ.get("NVSHARE_GPU_WORK_STEPS", "5500"))
    only = sys.argv[1:] or [
        "gated",
        "pair",
        "multigpu",
        "auto",
        "launch",
        "memory",
        "managed",
        "quota",
        "failsoft",
        "alloc",
        "kube",
        "realtime",
        "makespan",
        "held",
        "captures",
        "twogpu",
        "view",
        "graphmem",
    ]
    table: dict[str, Callable[[], None]] = {
        "gated": gated_torch,
        "pair": serialised_pair,
        "multigpu": multi_gpu,
        "auto": auto_mode,
        "launch": launch_bound,
        "memory": torch_memory,
        "managed": managed_backing,
        "quota": lambda: quota_accuracy(["torch alone 25", "torch two 30/70", "torch graph 30"]),
        "quota_table": lambda: quota_accuracy(None),
        "failsoft": fail_soft,
        "alloc": alloc_bench,
        "kube": kube_annotations,
        "realtime": realtime_extender,
        "makespan": lambda: makespan(steps),
        "held": held_memory,
        "captures": captures_under_drops,
        "twogpu": two_gpu,
        "view": gpu_view,
        "graphmem": graph_memory,
    }
    for name in only:
        t0 = time.monotonic()
        try:
            table[name]()
        except Exception as exc:  # one broken section must not hide the others
            check(f"{name} section ran", False, f"{type(exc).__name__}: {exc}"[:2000])
        print(f"-- {name}: {time.monotonic() - t0:.1f} s", flush=True)
    out = Path(os.environ.get("OUT", ".")) / "gpu_results.json"
    out.write_text(json.dumps({"results": RESULTS, "checks": CHECKS}, indent=2))
    print("\nSUMMARY")
    for name, ok, detail in CHECKS:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail[:300]}")
    failed = [c for c in CHECKS if not c[1]]
    print(f"{len(CHECKS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
