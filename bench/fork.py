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
        "C fork loop": [str(forkmem), str(args.rounds), "20"],
        "bash subshells": ["bash", "-c", f"for ((i = 0; i < {args.rounds}; i++)); do (:); done"],
    }
    have_uftrace = shutil.which("uftrace") is not None
    work = Path(tempfile.mkdtemp(prefix="bt-fork-", dir="/dev/shm"))
    print(f"{args.rounds} forks per run, best of {args.repeat}")
    print("| workload | native s | wrap s | slowdown | stream s | slowdown | grew MiB "
          "| uftrace -P . s | slowdown |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for name, argv in workloads.items():
            best: dict[str, float] = {}
            grew = None
            for _ in range(args.repeat):
                runs = {
                    "native": argv,
                    "wrap": ours(argv, work / "wrap", "wrap"),
                    "stream": ours(argv, work / "stream", "stream"),
                }
                for tool, command in runs.items():
                    dt, out = timed(command)
                    best[tool] = min(best.get(tool, dt), dt)
                    if tool == "wrap" and name == "C fork loop":
                        grew = growth_mib(out)
                if have_uftrace and name == "C fork loop":
                    dt, _ = timed(["uftrace", "record", "-P", ".", "-d", str(work / "uf"), *argv])
                    best["uftrace"] = min(best.get("uftrace", dt), dt)
            native = best["native"]
            uf = best.get("uftrace")
            print(
                f"| {name} | {native:.2f} | {best['wrap']:.2f} | {best['wrap'] / native:.1f}x "
                f"| {best['stream']:.2f} | {best['stream'] / native:.1f}x "
                f"| {'-' if grew is None else f'{grew:.1f}'} "
                f"| {'-' if uf is None else f'{uf:.2f}'} "
                f"| {'-' if uf is None else f'{uf / native:.1f}x'} |"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
