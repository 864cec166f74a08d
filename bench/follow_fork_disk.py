"""How much disk `record --follow-fork` takes for a program that forks often: the peak (the
recording directory's allocated blocks, sampled every 0.5 s) and what is left at the end.

    python bench/follow_fork_disk.py [--rounds 400] [--pause-ms 2] [--modes wrap,stream]
        [--buffer-size 16M] [--dir .]

Each ring is allocated whole while its thread runs and gives back what its records did not
use once the thread is done (Ring.release_unused), so the peak is a few rings, not one per
child.  The program is tests/programs/forkloop.c: ROUNDS children, PAUSE ms apart, each
calling a function 7 times and exiting.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def allocated(directory: Path) -> int:
    """Bytes of disk the files in `directory` take (holes not counted)."""
    total = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):  # replaced meanwhile (meta.json)
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def run(program: Path, out: Path, mode: str, args: argparse.Namespace) -> dict[str, object]:
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "branchtrace.cli.main", "record", "-o", str(out)]
    command += ["--mode", mode, "--buffer-size", args.buffer_size, "--follow-fork", "--"]
    command += [str(program), str(args.rounds), str(int(args.pause_ms * 1000))]
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.5):
            if out.exists():
                peak = max(peak, allocated(out))

    sampler = threading.Thread(target=sample)
    started = time.monotonic()
    sampler.start()
    try:
        recording = subprocess.run(command, capture_output=True, text=True, timeout=600)
    finally:
        done.set()
        sampler.join()
    seconds = time.monotonic() - started
    if recording.returncode != 0:
        print(recording.stderr, file=sys.stderr)
    meta = json.loads((out / "meta.json").read_text())
    final = allocated(out)
    return {
        "mode": mode,
        "peak": max(peak, final),
        "final": final,
        "seconds": seconds,
        "children": len(meta["processes"]),
        "records": sum(t["records"] for t in meta["threads"].values()),
        "status": recording.returncode,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400, help="children the program forks")
    parser.add_argument("--pause-ms", type=float, default=2, help="between two forks")
    parser.add_argument("--modes", default="wrap,stream")
    parser.add_argument("--buffer-size", default="16M")
    parser.add_argument("--dir", default=".", help="where to record (a disk, not tmpfs)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix=".bt-forkdisk-", dir=args.dir))
    program = work / "forkloop"
    subprocess.run(
        ["gcc", "-O1", "-o", str(program), str(ROOT / "tests/programs/forkloop.c")], check=True
    )
    rows = []
    try:
        for mode in args.modes.split(","):
            rows.append(run(program, work / "d", mode, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"record --follow-fork -- forkloop {args.rounds} {int(args.pause_ms * 1000)}, "
        f"--buffer-size {args.buffer_size}:"
    )
    print(f"{'mode':8} {'peak disk':>10} {'left':>10} {'time':>8} {'children':>9} {'records':>10}")
    for r in rows:
        print(
            f"{r['mode']:8} {r['peak'] / MIB:7.1f} MiB {r['final'] / MIB:6.1f} MiB "
            f"{r['seconds']:6.1f} s {r['children']:9} {r['records']:10,}"
            + ("" if r["status"] == 0 else f"  (status {r['status']})")
        )
    return 0 if all(r["status"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
