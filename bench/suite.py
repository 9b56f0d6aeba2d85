"""The whole workload suite on a GPU machine, one command, with its table.

    bash bench/suite.sh OUTDIR [--sections turns,modes,quotas,priorities,requests,crowd,gangs]
                               [--seconds 12] [--quota-seconds 60] [--turns-seconds 40.5]
    python3 bench/suite.py report OUTDIR          (anywhere: the table again, from the JSON)
    python3 bench/suite.py merge OUTDIR --part F  (a `bench/workloads.py --json F` run made
                                                   apart, into OUTDIR; then the table)

`run` (what suite.sh calls on the GPU machine after building the hook) runs `bench/workloads.py`
with every section (turns of every step shape, modes on/auto/off, quotas, priorities,
guaranteed shares, crowds of three and four loops) and, when the machine has two GPUs,
`bench/gangs.py` (2-GPU NCCL jobs, `.item()` and DDP steps, both orders, staggered), into
OUTDIR/workloads.json and OUTDIR/gangs.json, then writes OUTDIR/suite.md: the machine, the
date, and one table per feature with each figure judged against issue 22's targets. All of
it takes about an hour on an H100; `--sections` runs part of it, and what earlier runs into the
same OUTDIR measured is kept (a machine lent for ten minutes at a time runs it in parts). A
section that fails says why (its traceback) and the others still run; the table then keeps
that section's last good run, and `run` exits with 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
TQ_S, DROP_DEADLINE_S = 5.0, 5.0  # the workloads' quantum, the default scheduler.dropDeadline
STALL_BOUND_S = TQ_S + DROP_DEADLINE_S  # a pair: the other's quantum and a drop deadline
POISSON_BOUND, STEADY_BOUND, TRAINER_FLOOR = 2.0, 1.5, 0.8
QUOTA_SLACK = 1.0  # points
RUN_FIELDS = ("date", "machine", "gpus", "seconds", "quota_seconds", "turns_seconds")


def ok(good: bool) -> str:
    return "ok" if good else "**miss**"


def line(*cells: object) -> str:
    """A table row; a list or tuple cell is its items with slashes between them."""
    shown = (" / ".join(map(str, c)) if isinstance(c, list | tuple) else str(c) for c in cells)
    return "| " + " | ".join(shown) + " |"


def sections_of(res: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """A section's cases (its `section_s` and other plain figures left out)."""
    return ((k, v) for k, v in res.items() if isinstance(v, dict))


def turns(res: dict[str, Any]) -> Iterator[str]:
    yield line("pair", "split %", "combined (x alone)", "longest stall s", "verdict")
    yield "|---|---|---:|---|---|"
    for pair, r in sections_of(res):
        split, stall = list(r["split_pct"].values()), list(r["longest_stall_s"].values())
        good = all(abs(x - 50) <= 5 for x in split) and max(stall) <= STALL_BOUND_S
        yield line(pair, split, r["combined_of_alone"], stall, ok(good))


def modes(res: dict[str, Any]) -> Iterator[str]:
    yield line("mode", "split %", "combined (x alone)")
    yield "|---|---|---:|"
    for mode, r in sections_of(res):
        yield line(mode, list(r["split_pct"].values()), r["combined_of_alone"])


def quotas(res: dict[str, Any]) -> Iterator[str]:
    """Two verdicts: the time held (the limit's documented meaning: `held_*`, the share of the
    span the loop made steps in; older runs, the whole run's `held_pct` only) and the work,
    each over the first 1 s, the first 8 s and the whole run, within QUOTA_SLACK of the limit."""
    spans = ("1s", "8s", "whole")
    yield line("settings", "loop", "limit", "held 1 s / 8 s / whole", "pace",
               "work 1 s / 8 s / whole", "verdict: time held", "work")  # fmt: skip
    yield "|---|---|---:|---|---:|---|---|---|"
    for variant, row in sections_of(res):
        cases = [(n, r, r["limit"]) for n, r in row.items() if n != "25+75"]
        cases += [(n, r, int(n[1:3])) for n, r in row.get("25+75", {}).items()]
        for name, r, limit in cases:
            work = [r[f"share_{k}"] for k in spans]
            held = [r[f"held_{k}"] for k in spans] if "held_1s" in r else [r.get("held_pct")]
            held_ok = None not in held and all(abs(x - limit) <= QUOTA_SLACK for x in held)
            work_ok = all(abs(x - limit) <= QUOTA_SLACK for x in work)
            yield line(variant, name, limit, held, r.get("pace_of_solo"), work,
                       ok(held_ok), ok(work_ok))  # fmt: skip


def priorities(res: dict[str, Any]) -> Iterator[str]:
    yield line("requests", "case", "p99 ms (x alone)", "trainer (x solo)", "verdict")
    yield "|---|---|---|---:|---|"
    for spec, row in sections_of(res):
        bound = POISSON_BOUND if ":poisson:" in spec else STEADY_BOUND
        off = row["off"]["p99_ms"]
        for case, r in sections_of(row):
            good = case == "off" or (
                r["p99_x_alone"] <= bound
                and r["trainer_of_solo"] >= TRAINER_FLOOR
                and r["p99_ms"] <= off
            )
            p99 = f"{r['p99_ms']} ({r['p99_x_alone']}x)"
            yield line(f"{spec} (alone p99 {row['alone_p99_ms']})", case, p99,
                       r["trainer_of_solo"], ok(good))  # fmt: skip


def requests(res: dict[str, Any]) -> Iterator[str]:
    """Each client's work against its loop alone, and the share of the run it made steps in
    (`held`, as for quotas; older runs: work only)."""
    yield line("client", "guaranteed %", "work % of solo", "held %", "verdict: held")
    yield "|---|---:|---:|---:|---|"
    for name, got in res.items():
        if name != "section_s":
            work, held = (got["work"], got["held"]) if isinstance(got, dict) else (got, None)
            good = held is not None and held >= int(name[1:]) - QUOTA_SLACK
            yield line(name, name[1:], work, held if held is not None else "-", ok(good))


def crowd(res: dict[str, Any]) -> Iterator[str]:
    """N loops: each within 5 points of 100/N; no stall beyond the others' quanta and a drop
    deadline."""
    yield line("loops", "split %", "combined (x alone)", "longest stall s", "verdict")
    yield "|---|---|---:|---|---|"
    for case, r in sections_of(res):
        split, stall = list(r["split_pct"].values()), list(r["longest_stall_s"].values())
        n = r["loops"]
        bound = (n - 1) * TQ_S + DROP_DEADLINE_S
        good = all(abs(x - 100 / n) <= 5 for x in split) and max(stall) <= bound
        yield line(case, split, r["combined_of_alone"], stall, ok(good))


def gangs(res: dict[str, Any]) -> Iterator[str]:
    yield line("run", "split %", "combined", "longest gap s", "verdict")
    yield "|---|---|---:|---|---|"
    for r in res["runs"]:
        if "fair" in r:
            good = r["fair"] and r["throughput_ok"] and r["waits_ok"]
            gaps = list(r.get("longest_gap_s", r.get("longest_wait_s", {})).values())  # (older)
            yield line(r["run"], r["split_pct"], r["combined"], gaps, ok(good))


SECTIONS = {
    "turns": ("Turns: two loops at TQ 5 s, the second 0.5 s later", turns),
    "modes": ("Modes: two `train:item` loops", modes),
    "quotas": ("Quotas: shares from the first step, against the loop alone", quotas),
    "priorities": ("Priorities: inference at high beside a trainer", priorities),
    "requests": ("Guaranteed shares (coreRequest 30 and 70)", requests),
    "crowd": ("Crowds: three and four loops at TQ 5 s, staggered", crowd),
}


def report(out: Path) -> str:
    lines: list[str] = []
    work = json.loads((out / "workloads.json").read_text())
    lines += ["# Workload suite", ""]
    shown: set[str] = set()
    for r in reversed(work["runs"]):  # each section from the last run that measured it
        if mine := [s for s in r["sections"] if s not in shown]:
            shown |= set(mine)
            lines.insert(2, (
                f"- {', '.join(mine)}: {r['date']}, {', '.join(r['gpus'])}; {r['machine']}; "
                f"seconds a case {r['seconds']}, quota runs {r['quota_seconds']} s, "
                f"turns {r['turns_seconds']} s"
            ))  # fmt: skip
    lines.append("")
    for key, (title, table) in SECTIONS.items():
        if key in work:
            lines += [f"## {title}", "", *table(work[key]), ""]
    if (out / "gangs.json").exists():
        g = json.loads((out / "gangs.json").read_text())
        lines += [f"## Gangs: two 2-GPU jobs ({', '.join(g['gpus'])}; {g['date']})", ""]
        lines += [*gangs(g), ""]
    else:
        lines += ["## Gangs", "", "Not run: the machine has fewer than two GPUs.", ""]
    return "\n".join(lines)


def gpu_count() -> int:
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
    return len(smi.stdout.splitlines())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=("run", "report", "merge"))
    ap.add_argument("out", type=Path)
    ap.add_argument("--part", type=Path, help="merge: a bench/workloads.py --json file")
    ap.add_argument("--sections", default=",".join([*SECTIONS, "gangs"]))
    ap.add_argument("--seconds", default="12")
    ap.add_argument("--quota-seconds", default="60")
    ap.add_argument("--turns-seconds", default="40.5")
    args = ap.parse_args()
    failed = ""
    if args.what == "run":
        failed = run(args)
    elif args.what == "merge":
        args.out.mkdir(parents=True, exist_ok=True)
        merge(args.out, args.part)
    table = report(args.out)
    (args.out / "suite.md").write_text(table + "\n")
    print(table)
    if failed:
        print(f"\n{failed}; the table keeps those sections' last good runs", file=sys.stderr)
    return 1 if failed else 0


def merge(out: Path, part: Path) -> None:
    """A `bench/workloads.py --json` file's sections into OUT/workloads.json, with its run's
    machine and date (a later run of a section replaces an earlier one)."""
    new = json.loads(part.read_text())
    whole = out / "workloads.json"
    kept = json.loads(whole.read_text()) if whole.exists() else {"runs": []}
    about = {k: new.pop(k) for k in RUN_FIELDS if k in new}
    kept["runs"].append(about | {"sections": list(new)})
    whole.write_text(json.dumps(kept | new, indent=2) + "\n")


def run(args: argparse.Namespace) -> str:
    """The sections asked for, merged into what OUTDIR already holds; what failed, if any
    (a section that fails leaves the others to run: bench/workloads.py prints why)."""
    args.out.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-u"]
    wanted = args.sections.split(",")
    failed: list[str] = []
    if sections := [s for s in wanted if s in SECTIONS]:
        part = args.out / "workloads.part.json"
        done = subprocess.run(
            [*py, BENCH / "workloads.py", "--sections", ",".join(sections),
             "--seconds", args.seconds, "--quota-seconds", args.quota_seconds,
             "--turns-seconds", args.turns_seconds, "--json", part],
        )  # fmt: skip
        if part.exists():  # the sections it finished, also when it was cut short
            merge(args.out, part)
            part.unlink()
        if done.returncode != 0:
            failed.append(f"bench/workloads.py exited with {done.returncode}")
    if "gangs" in wanted and gpu_count() >= 2:
        done = subprocess.run([*py, BENCH / "gangs.py", "--json", args.out / "gangs.json"])
        if done.returncode != 0:
            failed.append(f"bench/gangs.py exited with {done.returncode}")
    return "; ".join(failed)


if __name__ == "__main__":
    sys.exit(main())
