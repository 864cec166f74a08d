"""What following a thread costs: the mean start (pthread_create() to the thread's first
line) and end (its last line to the end of pthread_join()) of THREADS threads started one
after another, native and under `record` in each mode.

    python bench/thread_start.py [--threads 400] [--repeat 3] [--modes wrap,stream]
        [--follow-fork]

With --follow-fork each mode is also run with that option, under which a new thread asks
the recorder for its ring and waits for it (docs/fork.md section 17).

The program is bench/programs/thread_start.c.  Prints one row per run, then the medians.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BT = [sys.executable, "-m", "branchtrace.cli.main"]


def run(argv: list[str]) -> tuple[float, float]:
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), float(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", default="wrap,stream")
    parser.add_argument("--follow-fork", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "thread_start"
        source = ROOT / "bench" / "programs" / "thread_start.c"
        subprocess.run(["gcc", "-O1", "-pthread", "-o", str(exe), str(source)], check=True)
        rows: dict[str, list[tuple[float, float]]] = {}
        for _ in range(args.repeat):
            rows.setdefault("native", []).append(run([str(exe), str(args.threads)]))
            variants = [[], ["--follow-fork"]] if args.follow_fork else [[]]
            for mode in args.modes.split(","):
                for extra in variants:
                    name = " ".join([mode, *extra])
                    out = Path(tmp) / f"d-{mode}{len(extra)}"
                    argv = [*BT, "record", "-o", str(out), "--mode", mode, *extra, "--"]
                    start, end = run([*argv, str(exe), str(args.threads)])
                    rows.setdefault(name, []).append((start, end))
                    print(f"{name}: start {start:.2f} ms, end {end:.2f} ms", flush=True)
        print(f"| {args.threads} threads | start ms (median) | end ms (median) |")
        print("|---|---|---|")
        for name, values in rows.items():
            start = statistics.median(v[0] for v in values)
            end = statistics.median(v[1] for v in values)
            print(f"| {name} | {start:.2f} | {end:.2f} |")


if __name__ == "__main__":
    main()
