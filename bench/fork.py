"""Recording programs that fork: `branchtrace record` against native runs and uftrace.

    python bench/fork.py [--rounds N] [--repeat R]

Two workloads, each forking N children one after the other: a C loop (tests/programs/
forkmem.c: each child exits at once) and a shell running N subshells (`bash -c 'for ...;
do (:); done'`), whose traced loop is larger than the C one.  Children are not followed
(no --follow-fork): what is measured is what each fork() costs the traced parent.  For
each: native seconds, ours in wrap and stream mode (best of R, taking turns with native),
the slowdown, and how much the C loop grew in virtual size from its 20th fork to its last
under us.  uftrace (`record -P .`, which follows children itself) is run on the C loop
when installed; it cannot patch bash, which was not built for it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import build  # noqa: E402  (the tests' cached gcc build)


def timed(argv: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, errors="replace")
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({res.returncode}): {res.stderr[-500:]}")
    return dt, res.stdout


def ours(argv: list[str], out: Path, mode: str) -> list[str]:
    return [sys.executable, "-m", "branchtrace.cli.main", "record", "--mode", mode,
            "-o", str(out), "--", *argv]  # fmt: skip


def growth_mib(stdout: str) -> float:
    sizes = [int(line.split()[2]) for line in stdout.splitlines() if line.startswith("vm ")]
    return (sizes[-1] - sizes[0]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    forkmem = build(ROOT / "tests" / "programs" / "forkmem.c", ["-O2", "-g"])
    workloads = {
        "C fork loop": lambda n: [str(forkmem), str(n), str(min(20, n))],
        "bash subshells": lambda n: ["bash", "-c", f"for ((i = 0; i < {n}; i++)); do (:); done"],
    }
    have_uftrace = shutil.which("uftrace") is not None
    work = Path(tempfile.mkdtemp(prefix="bt-fork-", dir="/dev/shm"))
    print(f"{args.rounds} forks per run, best of {args.repeat}; seconds for the forks alone")
    print("| workload | native s | wrap s | slowdown | stream s | slowdown | grew MiB "
          "| uftrace -P . s | slowdown |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for name, make in workloads.items():
            best: dict[tuple[str, int], float] = {}
            grew = None
            for _ in range(args.repeat):
                for n in (0, args.rounds):
                    argv = make(n)
                    runs = {
                        "native": argv,
                        "wrap": ours(argv, work / "wrap", "wrap"),
                        "stream": ours(argv, work / "stream", "stream"),
                    }
                    if have_uftrace and name == "C fork loop":
                        runs["uftrace"] = ["uftrace", "record", "-P", ".", "-d", str(work / "uf")]
                        runs["uftrace"] += argv
                    for tool, command in runs.items():
                        dt, out = timed(command)
                        best[tool, n] = min(best.get((tool, n), dt), dt)
                        if tool == "wrap" and n and name == "C fork loop":
                            grew = growth_mib(out)

            # seconds for the forks alone
            cost = {tool: best[tool, args.rounds] - best[tool, 0] for tool, _ in best}
            native = cost["native"]
            cells = [name, f"{native:.2f}"]
            for tool in ("wrap", "stream"):
                cells += [f"{cost[tool]:.2f}", f"{cost[tool] / native:.1f}x"]
            cells.append("-" if grew is None else f"{grew:.1f}")
            if "uftrace" in cost:
                cells += [f"{cost['uftrace']:.2f}", f"{cost['uftrace'] / native:.1f}x"]
            else:
                cells += ["-", "-"]
            print("| " + " | ".join(cells) + " |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
