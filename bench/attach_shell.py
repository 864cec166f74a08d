"""Attach `record -p` again and again to a shell that forks subshells without pause, and
count what became of the shell: it must run on, forking, after each detach.

    python bench/attach_shell.py [--runs 60] [--duration 1] [--mode wrap] [--follow-fork]

A reliability check, not a speed one (docs/fork.md, section 6).  A subshell forked while a
thread of Frida's holds a lock that the subshell's exit() takes (Frida's heap lock, the
mutex of Frida's thread registry, the C library's exit lock) sleeps or spins for good, and
the shell waiting for it hangs; the recorder releases such children, and the runs where it
did are counted apart.  Each outcome is one of: "ran on", "ran on, a stuck child
released", "hung" (the shell's child has not changed 0.5 s after the recording ended),
"killed by SIGNAL", "the agent did not answer" (the recorder said so; the shell ran on).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHELL = "while :; do (:); done"


def children(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return ""


def attach_once(out: Path, args: argparse.Namespace) -> str:
    shell = subprocess.Popen(["bash", "-c", SHELL], start_new_session=True)
    try:
        time.sleep(0.3)  # forking by now
        shutil.rmtree(out, ignore_errors=True)
        command = [sys.executable, "-m", "branchtrace.cli.main", "record", "-o", str(out)]
        command += ["--mode", args.mode, "--duration", str(args.duration), "-p", str(shell.pid)]
        command += ["--follow-fork"] if args.follow_fork else []
        recording = subprocess.run(command, capture_output=True, text=True, timeout=120)
        said = recording.stderr
        if shell.poll() is not None:
            print(said, file=sys.stderr)
            return f"killed by {signal.Signals(-shell.returncode).name}"
        before = children(shell.pid)
        time.sleep(0.5)
        if before and before == children(shell.pid):
            print(said, file=sys.stderr)
            return "hung"
        if "did not answer" in said:
            print(said, file=sys.stderr)
            return "the agent did not answer"
        return "ran on, a stuck child released" if "branchtrace released it" in said else "ran on"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--duration", type=float, default=1.0)
    parser.add_argument("--mode", default="wrap", choices=["stream", "wrap"])
    parser.add_argument("--follow-fork", action="store_true", help="trace the subshells too")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bt-attachshell-")) / "d"
    outcomes: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    try:
        for n in range(args.runs):
            outcome = attach_once(out, args)
            outcomes[outcome] += 1
            print(f"{n + 1:3d}  {time.monotonic() - started:6.1f} s  {outcome}", flush=True)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    summary = ", ".join(f"{count} {outcome}" for outcome, count in outcomes.most_common())
    how = f"{args.mode}{', --follow-fork' if args.follow_fork else ''}, {args.duration} s"
    what = f"{args.runs} attaches ({how}) to `bash -c '{SHELL}'`"
    print(f"{what}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
