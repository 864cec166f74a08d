"""Attach `record --follow-fork` to a program that forks every 50 ms, again and again, with
busy loops on the other cores, and count what went wrong: the program must finish and count
all its children (40) exiting 0, and the recording must end with status 0.

    python bench/follow_fork_stress.py [--runs 16] [--busy 1] [--mode stream] [--duration 3]
        [--rounds 40] [--pause-ms 50] [--child-ms 0] [--child-exit _exit|exit]
        [--start-after-ms 0] [--no-follow-fork] [--plain-frida [gating|spawn]] [--spawn]

A reliability check, not a speed one: Frida's fork handling under child gating has races
that show only under load (see docs/fork.md).  `--rounds 400 --pause-ms 2 --no-follow-fork`
shows another one: a child forked while Frida is injected can be left spinning in its
_exit() on Frida's heap lock (a program that waits for it hangs).  The recorder releases
such children; the runs where it did are counted apart, and the state of every child of a
hung program is printed.  So are the runs where Frida dropped its session with the program
midway (the recorder says so; the trace ends there).  `--plain-frida` attaches Frida
alone (a one-line script, then detach) instead of recording, `--plain-frida gating` the
same with Frida's child gating on (each child resumed as reported: what `--follow-fork`
asks of Frida, without our agent), `--plain-frida spawn` spawns the program with Frida
alone, child gating on in it and in each child (what `record --follow-fork` asks of Frida
from a program's start) and names where a frozen program stopped, and `--start-after-ms` lets
the program start forking only after the attach.  `--spawn` records the program from its
start to its end instead (no attach, no --duration); a child whose trace is cut short is
counted too.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Frida alone: attach, load a one-line script, wait, detach (argv: pid, seconds)
PLAIN_FRIDA = """
import sys, time, frida
session = frida.attach(int(sys.argv[1]))
session.create_script("send(1);").load()
time.sleep(float(sys.argv[2]))
session.detach()
"""
#: the same with child gating on, each child resumed as Frida reports it (argv as above)
PLAIN_FRIDA_GATING = """
import sys, threading, time, frida
device = frida.get_local_device()
session = device.attach(int(sys.argv[1]))
session.create_script("send(1);").load()
device.on("child-added", lambda c: threading.Thread(target=device.resume, args=(c.pid,)).start())
session.enable_child_gating()
time.sleep(float(sys.argv[2]))
session.disable_child_gating()
session.detach()
"""
#: Frida alone, as `record --follow-fork` asks of it from a program's start: spawn it (argv:
#: the program and its arguments), child gating on, each child attached with a one-line
#: script and its own gating on, then resumed.  It watches the program for the freeze of
#: docs/fork.md section 5: a thread of it held in a tracing stop by a thread of this process
#: (Frida's injector) for 1 s, and then says where it stopped, in Frida's agent, and kills it.
PLAIN_FRIDA_SPAWN = """
import os, sys, threading, time, frida
device = frida.get_local_device()
pid = device.spawn(sys.argv[1:], stdio="pipe")
printed = []
device.on("output", lambda p, fd, data: printed.append(data) if p == pid and fd == 1 else None)
def follow(child):
    try:
        session = device.attach(child.pid)
        session.create_script("send(1);").load()
        session.enable_child_gating()
    finally:
        device.resume(child.pid)
device.on("child-added", lambda c: threading.Thread(target=follow, args=(c,)).start())
ended = threading.Event()
session = device.attach(pid)
session.on("detached", lambda *_: ended.set())
session.create_script("send(1);").load()
session.enable_child_gating()
device.resume(pid)
def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
def agent_offset(pc):
    for line in read(f"/proc/{pid}/maps").splitlines():
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= pc < end and "frida-agent" in line:
            return f"frida-agent+{pc - start + int(fields[2], 16):#x}"
    return f"{pc:#x}, outside Frida's agent"
stopped_since = {}
while not ended.wait(0.1):
    ours = set(os.listdir("/proc/self/task"))
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.exists(f"/proc/{pid}/task") else []:
        status = dict(l.split(":", 1) for l in read(f"/proc/{pid}/task/{tid}/status").splitlines())
        if status.get("State", "").split()[:1] == ["t"] and status["TracerPid"].strip() in ours:
            if time.monotonic() - stopped_since.setdefault(tid, time.monotonic()) > 1:
                pc = int(read(f"/proc/{pid}/task/{tid}/syscall").split()[-1], 16)
                print(f"frozen: thread {tid} stopped at {agent_offset(pc)}", flush=True)
                os.kill(pid, 9)
                os._exit(0)
        else:
            stopped_since.pop(tid, None)
print(b"".join(printed).decode(errors="replace"), flush=True)
"""


def children_states(pid: int) -> str:
    """Each child of `pid`: its pid, state (R: running) and where it waits."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return ", ".join(
            f"{kid} {Path(f'/proc/{kid}/stat').read_text().split()[2]} "
            f"{Path(f'/proc/{kid}/wchan').read_text() or '-'}"
            for kid in kids
        )
    except OSError as e:
        return str(e)


FROZEN_CHILD = "a child frozen in Frida's recovery from fork() killed, the program went on"
RELEASED = "ok, a child stuck on a lock of Frida's released"


def finish(recording: subprocess.Popen, timeout: float) -> tuple[str, str] | None:
    """The recording's stdout and stderr once it ended; None if it did not within `timeout`
    (its faulthandler then prints every thread's stack, shown on stderr)."""
    try:
        return recording.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        recording.send_signal(signal.SIGABRT)
        print(recording.communicate()[1], file=sys.stderr)
        return None


def spawn_once(program: Path, out: Path, args: argparse.Namespace) -> str:
    """`record --follow-fork -- forkloop ...`: the recording ends with the program."""
    shutil.rmtree(out, ignore_errors=True)
    argv = [str(program), str(args.rounds), str(int(args.pause_ms * 1000)), "0"]
    command = [sys.executable, "-X", "faulthandler", "-m", "branchtrace.cli.main", "record"]
    command += ["-o", str(out), "--mode", args.mode, "--follow-fork", "--", *argv]
    command += [str(int(args.child_ms * 1000)), args.child_exit]
    recording = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        ended = finish(recording, 300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(recording.pid, signal.SIGKILL)
    if ended is None:
        return "the recording did not end within 300 s"
    printed, said = ended
    if recording.returncode != 0 or printed.split()[-1:] != [str(args.rounds)]:
        print(said, file=sys.stderr)
        if "so that its parent could go on" in said:
            return FROZEN_CHILD
        if "faulted inside Frida's recovery" in said:
            return "the program froze in Frida's recovery from fork() and was killed"
        return f"recording status {recording.returncode}, {printed.split()[-1:]} good children"
    meta = json.loads((out / "meta.json").read_text())
    children = [t for tid, t in meta["threads"].items() if int(tid) != meta["pid"]]
    short = [t["records"] for t in children if t["records"] < 100]  # each runs ~140 records
    if len(children) != args.rounds or short:
        print(said, file=sys.stderr)
        return f"{len(children)} children traced, {len(short)} with a short trace ({short})"
    if "branchtrace released it" in said:
        return RELEASED
    return "ok"


def plain_spawn_once(program: Path, args: argparse.Namespace) -> str:
    """Frida alone spawns forkloop with child gating (PLAIN_FRIDA_SPAWN)."""
    argv = [str(program), str(args.rounds), str(int(args.pause_ms * 1000)), "0"]
    argv += [str(int(args.child_ms * 1000)), args.child_exit]
    command = [sys.executable, "-c", PLAIN_FRIDA_SPAWN, *argv]
    run = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        ended = finish(run, 60 + args.rounds * (args.pause_ms + args.child_ms) / 1000)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
    if ended is None:
        return "the program hung (no thread of it held by Frida's injector)"
    printed = ended[0].split()
    if printed[:1] == ["frozen:"]:
        return f"the program froze in Frida's recovery from fork() ({' '.join(printed[1:])})"
    if printed[-1:] != [str(args.rounds)]:
        print(ended[1], file=sys.stderr)
        return f"{printed[-1:] or 'no'} good children of {args.rounds}"
    return "ok"


def run_once(program: Path, out: Path, args: argparse.Namespace) -> str:
    if args.plain_frida == "spawn":
        return plain_spawn_once(program, args)
    if args.spawn:
        return spawn_once(program, out, args)
    pause_us, child_us = int(args.pause_ms * 1000), int(args.child_ms * 1000)
    argv = [str(args.rounds), str(pause_us), str(args.start_after_ms), str(child_us)]
    target = subprocess.Popen(
        [program, *argv, args.child_exit],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert target.stdout is not None
        target.stdout.readline()  # "ready"
        shutil.rmtree(out, ignore_errors=True)
        command = [sys.executable, "-X", "faulthandler"]
        if args.plain_frida:
            script = PLAIN_FRIDA_GATING if args.plain_frida == "gating" else PLAIN_FRIDA
            command += ["-c", script, str(target.pid), str(args.duration)]
        else:
            command += ["-m", "branchtrace.cli.main", "record", "-o", str(out)]
            command += ["--mode", args.mode, "--duration", str(args.duration)]
            command += [] if args.no_follow_fork else ["--follow-fork"]
            command += ["-p", str(target.pid)]
        recording = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started = time.monotonic()
        ended = finish(recording, 120)
        if ended is None:
            return "the recording did not end within 120 s"
        said = ended[1]
        if time.monotonic() - started > args.duration + 8:  # say what held it up
            print(said, file=sys.stderr)
        try:
            printed, _ = target.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            print(said, file=sys.stderr)
            status, children = recording.returncode, children_states(target.pid)
            return f"the program hung (recording status {status}; children: {children})"
        if target.returncode < 0:
            print(said, file=sys.stderr)
            died = f"the program died of {signal.Signals(-target.returncode).name}"
            if f"pid {target.pid} faulted inside Frida's recovery" in said:
                return f"{died}: it froze in Frida's recovery from fork(), the recording ended"
            return died
        if recording.returncode != 0:
            print(said, file=sys.stderr)
            return f"recording status {recording.returncode}"
        if "so that its parent could go on" in said and printed.strip() == str(args.rounds - 1):
            print(said, file=sys.stderr)
            return FROZEN_CHILD
        if printed.strip() != str(args.rounds):
            print(said, file=sys.stderr)
            return f"{printed.strip() or 'no'} good children of {args.rounds}"
        if "dropped its session" in said:
            print(said, file=sys.stderr)
            return "Frida dropped the program's session (it ran on fine; its trace ends early)"
        if "branchtrace released it" in said:
            return RELEASED
        return "ok"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(target.pid, signal.SIGKILL)
        target.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--busy", type=int, default=1, help="busy loops running meanwhile")
    parser.add_argument("--mode", default="stream", choices=["stream", "wrap"])
    parser.add_argument("--duration", type=float, default=3)
    parser.add_argument("--rounds", type=int, default=40, help="children the program forks")
    parser.add_argument("--pause-ms", type=float, default=50, help="between two forks")
    parser.add_argument("--child-ms", type=float, default=0, help="each child lives this long")
    parser.add_argument(
        "--child-exit",
        default="_exit",
        choices=["_exit", "exit"],
        help="how a child ends: exit() runs the exit handlers, as a shell's subshell does",
    )
    parser.add_argument("--start-after-ms", type=int, default=0, help="before the first fork")
    parser.add_argument("--no-follow-fork", action="store_true")
    parser.add_argument(
        "--spawn", action="store_true", help="record the program from its start, to its end"
    )
    parser.add_argument(
        "--plain-frida",
        nargs="?",
        const="attach",
        choices=["attach", "gating", "spawn"],
        help="attach Frida alone, not record (gating: with child gating on, as --follow-fork; "
        "spawn: spawn the program, gating on in it and in each child)",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bt-forkstress-"))
    program = work / "forkloop"
    subprocess.run(
        ["gcc", "-O1", "-o", str(program), str(ROOT / "tests/programs/forkloop.c")], check=True
    )
    busy = [
        subprocess.Popen(["sh", "-c", "while :; do :; done"], start_new_session=True)
        for _ in range(args.busy)
    ]
    outcomes: collections.Counter[str] = collections.Counter()
    try:
        for n in range(args.runs):
            started = time.monotonic()
            outcome = run_once(program, work / "d", args)
            outcomes[outcome.split(" (")[0]] += 1
            print(f"{n + 1:3d}  {time.monotonic() - started:5.1f} s  {outcome}", flush=True)
    finally:
        for loop in busy:
            os.killpg(loop.pid, signal.SIGKILL)
            loop.wait()
        shutil.rmtree(work, ignore_errors=True)
    summary = ", ".join(f"{count} {outcome}" for outcome, count in outcomes.most_common())
    if args.plain_frida:
        kind = {"attach": "attaches", "gating": "attaches", "spawn": "spawned runs"}
        what = f"{kind[args.plain_frida]} (plain Frida"
        what += "" if args.plain_frida == "attach" else ", child gating"
    else:
        what = f"recordings ({args.mode}" + (", spawned" if args.spawn else "")
    what += "" if args.plain_frida or args.no_follow_fork else ", --follow-fork"
    print(
        f"{args.runs} {what}, {args.busy} busy loops, a fork every {args.pause_ms:g} ms, "
        f"children living {args.child_ms:g} ms): {summary}"
    )
    return 0 if sum(n for o, n in outcomes.items() if o.startswith("ok")) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
