"""Children forked while Frida's agent is injected into a running process, and freeing the
ones that spin on Frida's heap lock; processes Frida's injector holds stopped for good
(stopped_by_us, StopClock, kill_held: the stalker engine's frozen checks).

Frida (17.26.2) hooks exit(), _exit() and abort() as soon as its agent starts, and its
threads take the agent's heap lock (a dlmalloc spin lock) again and again while the agent
and our script load.  A child forked at such a moment inherits that lock held by a thread
it does not have.  Its first exit() enters Frida's hook, which allocates, and spins on the
lock for good (a sched_yield() every 64 tries); a parent waiting for it hangs too.  Plain
Frida does the same (bench/follow_fork_stress.py --plain-frida); frida/frida#467 is the
upstream issue.  Children forked after the attach are safe.

A single-threaded process spinning on a held spin lock can never get it: no thread of its
own will release it.  So the one way it goes on is that someone else releases it: we stop
the child with ptrace, check that it is in that loop, write 0 to the lock and let it go.
The heap the lock guarded may have been mid-update in the forking parent; in the measured
runs the freed children exited normally (docs/fork.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

from . import ptrace as pt

#: dlmalloc's spin_acquire_lock in frida-agent-64.so 17.x, from the loop head:
#: `mov eax,[rbx]; test eax,eax; je take; inc ebp; test bpl,63; jne head; call sched_yield;
#: jmp head; take: mov eax,r12d; xchg [rbx],eax; test eax,eax; jne spin`.  The lock is rbx.
_SPIN_LOOP = re.compile(
    rb"\x8b\x03\x85\xc0\x74.\xff\xc5\x40\xf6\xc5\x3f\x75.\xe8....\xeb."
    rb"\x44\x89\xe0\x87\x03\x85\xc0\x75.",
    re.DOTALL,
)
_SPIN_LOOP_LEN = 30
_AFTER_YIELD_CALL = 19  #: the return address of the sched_yield call, from the loop head


def child_pids(pid: int) -> set[int]:
    """The children of every thread of `pid`, read from `pid`'s /proc files only."""
    kids: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        with contextlib.suppress(OSError):
            kids.update(map(int, Path(f"/proc/{pid}/task/{tid}/children").read_text().split()))
    return kids


def children(pid: int) -> dict[int, int]:
    """The live children of every thread of `pid`: pid -> start time (clock ticks)."""
    kids: dict[int, int] = {}
    for kid in child_pids(pid):
        stat = proc_stat(kid)
        if stat is not None:
            kids[kid] = int(stat[19])
    return kids


_KCMP_VM = 1
_SYS_KCMP = 312


def _shares_memory(pid: int, other: int) -> bool:
    """Whether `other` runs in `pid`'s memory (a clone with CLONE_VM, as Frida's helper
    that ptraces a thread for Stalker is): not a forked copy, so it inherited no lock."""
    return int(pt.libc.syscall(_SYS_KCMP, pid, other, _KCMP_VM, 0, 0)) == 0


def stopped_by_us(pid: int) -> int | None:
    """A thread of `pid` in a tracing stop whose tracer is a thread of this process, or None.
    The recorder ptraces only forked children (`_stop`, for a moment), so in a traced
    process that tracer is Frida's injector, which runs in the recorder's process."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        tracer = fields.get("TracerPid", "0").strip()
        if (
            fields.get("State", "").strip().startswith("t")
            and tracer != "0"
            and os.path.exists(f"/proc/self/task/{tracer}")
        ):
            return int(tid)
    return None


class StopClock:
    """For how long, on end, each process has been seen held in a tracing stop by a thread of
    this process (stopped_by_us)."""

    def __init__(self) -> None:
        self._since: dict[int, float] = {}

    def held_for(self, pid: int, stopped: bool | None = None) -> float | None:
        """Seconds `pid` has been held so when looked at now (None if it is not); `stopped`:
        as the caller found it, instead of stopped_by_us(pid)."""
        if stopped is None:
            stopped = stopped_by_us(pid) is not None
        if not stopped:
            self._since.pop(pid, None)
            return None
        now = time.monotonic()
        return now - self._since.setdefault(pid, now)

    def keep(self, pids: set[int]) -> None:
        """Forget every other process: a pid may be another process's when seen again."""
        self._since = {pid: since for pid, since in self._since.items() if pid in pids}


def kill_held(pid: int) -> None:
    """SIGKILL `pid`, a process held in a tracing stop by a thread of this process, and reap
    it: its parent hears of its end only once its tracer has reaped it, and that thread may
    never do so (any thread of the tracer's process may)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG | pt.WALL)[0]:
                return
        except ChildProcessError:  # reaped by its tracer already
            return
        time.sleep(0.001)


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from the state on (index 0 is the state, 17 the threads, 19 the start)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _agent_code(pid: int, address: int) -> bool:
    """Whether `address` is in code of Frida's agent in `pid`."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return False
    for line in maps:
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return "x" in fields[1] and len(fields) == 6 and "frida-agent" in fields[5]
    return False


def _read(pid: int, address: int, size: int) -> bytes:
    """`size` bytes of `pid`'s memory at `address`; b"" if some are not mapped."""
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            mem.seek(address)
            return mem.read(size)
    except (OSError, ValueError):
        return b""


def _spin_lock(pid: int, regs: pt.Regs) -> int | None:
    """The address of the Frida heap lock the stopped `pid` spins on, or None if it is not
    in that loop: its pc in the loop, or in the sched_yield() the loop calls."""
    pc = regs["rip"]
    if _agent_code(pid, pc):
        for head in range(pc - _SPIN_LOOP_LEN + 1, pc + 1):
            if _SPIN_LOOP.fullmatch(_read(pid, head, _SPIN_LOOP_LEN)):
                return regs["rbx"]
    back = int.from_bytes(_read(pid, regs["rsp"], 8), "little")
    head = back - _AFTER_YIELD_CALL
    if _agent_code(pid, head) and _SPIN_LOOP.fullmatch(_read(pid, head, _SPIN_LOOP_LEN)):
        return regs["rbx"]
    return None


def _stop(pid: int) -> bool:
    """Seize and stop `pid` (a process of one thread); False if it cannot be."""
    try:
        pt.call(pt.PTRACE_SEIZE, pid)
        pt.call(pt.PTRACE_INTERRUPT, pid)
    except OSError:
        return False
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG | pt.WALL)
        except ChildProcessError:
            done = 0
        stat = proc_stat(pid)
        if done or (stat is not None and stat[0] == "t"):
            return True
        time.sleep(0.001)
    _let_go(pid)
    return False


def _let_go(pid: int) -> None:
    try:
        pt.call(pt.PTRACE_DETACH, pid)
    except OSError:
        # it died while ours (SIGKILL): its parent hears of it only once we have reaped it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG | pt.WALL)


def stuck_on(pid: int) -> int | None:
    """The address of the held Frida heap lock `pid`, of one thread, spins on, or None."""
    stat = proc_stat(pid)
    if stat is None or stat[0] != "R" or stat[17] != "1" or not _stop(pid):
        return None
    try:
        lock = _spin_lock(pid, pt.getregs(pid))
        if lock is None or _read(pid, lock, 4) in (b"", b"\0\0\0\0"):
            return None
        return lock
    except OSError:
        return None
    finally:
        _let_go(pid)


def release(pid: int, lock: int) -> bool:
    """Clear the spin lock at `lock` in `pid`: the spinning thread takes it at its next try."""
    try:
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(lock)
            mem.write(b"\0\0\0\0")
        return True
    except OSError:
        return False


def free_if_stuck(pid: int) -> bool:
    """If `pid` spins on a held Frida heap lock: release it, True."""
    lock = stuck_on(pid)
    return lock is not None and release(pid, lock)


class ForksUnderFrida:
    """The children `pid` forks from `__init__` (call it before Frida attaches) on, freed
    when they spin on the inherited heap lock.

    The riskiest children are forked while Frida's threads are busy: while the agent and
    our script load (until `attached()`) and while they unload (from `detaching()` until
    `settle()` sees the agent gone).  With child gating on, the children forked between
    `attached(follow_new=False)` and `detaching()` are left alone: Frida ptraces them to
    inject its agent, and a second tracer would break that."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._before = children(pid)
        self._watched: dict[int, int] = {}
        self._risky: set[int] = set()
        self._follow_new = True
        self._seen_before_detach: set[int] | None = None
        self.freed: list[int] = []  #: released once, and went on
        self.stuck: list[int] = []  #: spinning on a lock again after its release
        self._released: dict[int, set[int]] = {}  #: child -> the locks released in it

    def attached(self, follow_new: bool) -> None:
        self._refresh()
        self._risky = set(self._watched)
        self._follow_new = follow_new

    def detaching(self) -> None:
        self._follow_new = True
        self._seen_before_detach = set(self._watched)

    def _refresh(self) -> None:
        if self._follow_new:
            for kid, start in children(self.pid).items():
                if (
                    self._before.get(kid) != start
                    and kid not in self._watched
                    and not _shares_memory(self.pid, kid)
                ):
                    self._watched[kid] = start
                    if self._seen_before_detach is not None:
                        self._risky.add(kid)
        for kid, start in list(self._watched.items()):
            stat = proc_stat(kid)
            if stat is None or int(stat[19]) != start or stat[0] in "ZX":
                del self._watched[kid]

    def free_stuck(self) -> None:
        self._refresh()
        for kid in sorted(self._watched.keys() - set(self.stuck)):
            lock = stuck_on(kid)
            if lock is None:
                continue
            released = self._released.setdefault(kid, set())
            if lock in released:
                # on a lock released once already, the child holds it itself (re-entered):
                # releasing it again would break its own critical section
                self.stuck.append(kid)
            elif release(kid, lock):
                released.add(lock)
                if kid not in self.freed:
                    self.freed.append(kid)

    def settle(self, timeout: float = 2.0, grace: float = 0.2) -> list[int]:
        """After the detach: free stuck children until Frida's agent has left the process
        and `grace` more seconds (a child forked just before needs a moment to reach its
        exit), or until none of the risky ones runs.  Returns the risky ones still running:
        each may hang when it exits, after we are gone."""
        deadline = time.monotonic() + timeout
        gone_at = None
        while True:
            self.free_stuck()
            risky = sorted(self._risky & self._watched.keys())
            now = time.monotonic()
            if gone_at is None and not _agent_loaded(self.pid):
                gone_at = now
            if now > deadline or (gone_at is not None and (not risky or now > gone_at + grace)):
                return risky
            time.sleep(0.02)


def _agent_loaded(pid: int) -> bool:
    try:
        return "frida-agent" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
