"""Children forked while Frida's agent is injected into a running process, and freeing the
ones stuck on a lock of Frida's; processes Frida's injector holds stopped for good
(stopped_by_us, StopClock, kill_held: the stalker engine's frozen checks).

Frida (17.26.2) hooks exit(), _exit() and abort() as soon as its agent starts, and its
threads take the agent's heap lock (a dlmalloc spin lock) again and again while the agent
and our script load.  A child forked at such a moment inherits that lock held by a thread
it does not have.  Its first exit() enters Frida's hook, which allocates, and spins on the
lock for good (a sched_yield() every 64 tries); a parent waiting for it hangs too.  Plain
Frida does the same (bench/follow_fork_stress.py --plain-frida); frida/frida#467 is the
upstream issue.  The same goes for a mutex: a shell's subshell, forked while a thread of
Frida's held the mutex of Frida's thread registry (as the script's thread observer is set
up), sleeps for good in its exit(), where the registry's hook on __call_tls_dtors() takes
that mutex to forget the thread; and for the C library's lock of its exit handlers, which
the thread unloading the agent holds as it runs the agent's handlers (__cxa_finalize).

A single-threaded process waiting on a lock that a thread it does not have holds can never
get it: no thread of its own will release it.  So the one way it goes on is that someone
else releases it: we stop the child with ptrace, check that it waits on that lock (its pc
in the spin loop; asleep on a pthread mutex whose owner is another thread, called from
Frida's code; or, forked while the agent loaded or unloaded, asleep in exit() on a lock in
the C library's data), clear the lock and let it go.  The data the lock guarded may have been
mid-update in the forking parent; in the measured runs the freed children exited normally
(docs/fork.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import time
from pathlib import Path
from typing import NamedTuple

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

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
#: gum_spinlock_acquire in frida-agent-64.so 17.x, which never yields: `xor edx,edx;
#: mov ecx,1; loop: mov eax,edx; lock cmpxchg [rdi],ecx; jne loop; ret`.  The lock is rdi.
#: A child forked while a thread of Frida's held one of Gum's spin locks (one guarding a
#: table in the agent's data, taken in Frida's exit() hook) spun in it for good, and its
#: parent waited for it (forkloop 400 2000, attached for 1 s: 1 run of 211).
_GUM_SPIN = b"\x31\xd2\xb9\x01\x00\x00\x00\x89\xd0\xf0\x0f\xb1\x0f\x75\xf8\xc3"
_GUM_SPIN_LOOP = range(7, 15)  #: where in it the pc spins


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


def _mappings(pid: int) -> list[tuple[int, int, str, str]]:
    """`pid`'s mappings: (start, end, permissions, path or "")."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in maps:
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        found.append((low, high, fields[1], fields[5] if len(fields) == 6 else ""))
    return found


def _code_of(mappings: list[tuple[int, int, str, str]], address: int) -> str | None:
    """The path of the executable mapping `address` is in ("" if anonymous), or None."""
    for low, high, permissions, path in mappings:
        if low <= address < high:
            return path if "x" in permissions else None
    return None


def _agent_code(pid: int, address: int) -> bool:
    """Whether `address` is in code of Frida's agent in `pid`."""
    return "frida-agent" in (_code_of(_mappings(pid), address) or "")


def _read(pid: int, address: int, size: int) -> bytes:
    """`size` bytes of `pid`'s memory at `address`; b"" if some are not mapped."""
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            mem.seek(address)
            return mem.read(size)
    except (OSError, ValueError):
        return b""


def _spin_lock(pid: int, regs: pt.Regs) -> int | None:
    """The address of the spin lock of Frida's the stopped `pid` spins on, or None if it is
    not in such a loop: its pc in the heap lock's loop, or in the sched_yield() that loop
    calls, or in Gum's spin loop."""
    pc = regs["rip"]
    if _agent_code(pid, pc):
        for head in range(pc - _SPIN_LOOP_LEN + 1, pc + 1):
            if _SPIN_LOOP.fullmatch(_read(pid, head, _SPIN_LOOP_LEN)):
                return regs["rbx"]
        for at in _GUM_SPIN_LOOP:
            if _read(pid, pc - at, len(_GUM_SPIN)) == _GUM_SPIN:
                return regs["rdi"]
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


class HeldLock(NamedTuple):
    """A lock that a child waits on for good, held at its fork by a thread it does not have:
    Frida's heap lock or one of Gum's spin locks, which it spins on ("spin"); a pthread
    mutex taken by Frida's code ("mutex"); or a lock of the C library's that its exit()
    takes ("libc")."""

    address: int
    kind: str = "spin"


_SYS_FUTEX = 202
_FUTEX_WAIT_PRIVATE = 0x80
#: glibc's __lll_lock_wait() sleeps while the lock word reads 2: taken, with waiters
_LOCKED_WITH_WAITERS = 2
#: pthread_mutex_t's kinds that lock with __lll_lock_wait(): normal, recursive, error
#: checking, adaptive; not robust, priority-inheriting or -protecting, or process-shared
_PLAIN_MUTEX_KINDS = (0, 1, 2, 3)
_STACK_WORDS = 64  #: how far up its stack a child is looked at for who called the lock


def _futex_wait(pid: int) -> tuple[int, int] | None:
    """(the lock word, the stack pointer) of `pid` asleep in glibc's wait for a taken lock,
    read from /proc without stopping it; None if it is not."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return None
    if len(fields) != 9 or fields[0] != str(_SYS_FUTEX):
        return None
    word, op, value = (int(x, 16) for x in fields[1:4])
    if op != _FUTEX_WAIT_PRIVATE or value != _LOCKED_WITH_WAITERS:
        return None
    return word, int(fields[7], 16)


def _mutex(pid: int, address: int) -> tuple[int, int, int, int, int] | None:
    """pthread_mutex_t's first fields at `address`: lock, count, owner, users, kind."""
    data = _read(pid, address, 20)
    if len(data) != 20:
        return None
    lock, count, owner, users, kind = (
        int.from_bytes(data[i : i + 4], "little", signed=True) for i in range(0, 20, 4)
    )
    return lock, count, owner, users, kind


def _called_from_agent(pid: int, sp: int) -> bool:
    """Whether the first return address up `pid`'s stack from `sp` that is not into the C
    library's code is into Frida's agent: the lock was taken by Frida's code, not the
    program's (whose own deadlocks are not ours to break)."""
    mappings = _mappings(pid)
    stack = _read(pid, sp, 8 * _STACK_WORDS)
    for i in range(0, len(stack) - 7, 8):
        path = _code_of(mappings, int.from_bytes(stack[i : i + 8], "little"))
        if path is None or Path(path).name.startswith(("libc.so", "libc-", "libpthread")):
            continue
        return "frida-agent" in path
    return False


def _mutex_held_elsewhere(pid: int, address: int, sp: int) -> HeldLock | None:
    """The pthread mutex at `address` that `pid`, of one thread, sleeps on for good: taken
    by Frida's code, and owned by a thread that is not its own (one of the forking
    parent's)."""
    mutex = _mutex(pid, address)
    if mutex is None:
        return None
    lock, _, owner, _, kind = mutex
    if lock != _LOCKED_WITH_WAITERS or owner in (0, pid) or kind not in _PLAIN_MUTEX_KINDS:
        return None
    return HeldLock(address, "mutex") if _called_from_agent(pid, sp) else None


def _libc(mappings: list[tuple[int, int, str, str]]) -> tuple[str, int, int] | None:
    """The C library the program runs: (its path, where it is loaded, the end of its data
    and the zeroed memory that follows).  Frida maps a copy of it to read, never to run:
    the one with code is the program's."""
    found = [
        i
        for i, (_, _, permissions, path) in enumerate(mappings)
        if "x" in permissions and Path(path).name.startswith("libc.so")
    ]
    if not found:
        return None
    first = last = found[0]
    path = mappings[first][3]

    def touching(i: int, j: int) -> bool:
        return mappings[i][1] == mappings[j][0]

    while first > 0 and mappings[first - 1][3] == path and touching(first - 1, first):
        first -= 1
    while last + 1 < len(mappings) and mappings[last + 1][3] == path and touching(last, last + 1):
        last += 1
    if last + 1 < len(mappings) and not mappings[last + 1][3] and touching(last, last + 1):
        last += 1  # its .bss
    return path, mappings[first][0], mappings[last][1]


@functools.lru_cache(maxsize=8)
def _function(path: str, name: str) -> tuple[int, int] | None:
    """(offset, size) of the function `name` that the ELF file at `path` exports (read
    once: stuck children are looked at every FORK_CHECK_INTERVAL)."""
    try:
        with open(path, "rb") as f:
            symbols = ELFFile(f).get_section_by_name(".dynsym")
            if not isinstance(symbols, SymbolTableSection):
                return None
            found = symbols.get_symbol_by_name(name)
            if not found:
                return None
            return int(found[0]["st_value"]), int(found[0]["st_size"])
    except (OSError, ELFError):
        return None


def _libc_lock_in_exit(pid: int, address: int, sp: int) -> HeldLock | None:
    """The lock of the C library at `address` that `pid`, of one thread, sleeps on for good
    inside exit(): the lock of its list of exit handlers, which a thread of Frida's holds
    as the agent unloads (__cxa_finalize runs the agent's handlers)."""
    mappings = _mappings(pid)
    libc = _libc(mappings)
    if libc is None:
        return None
    path, start, end = libc
    exit_function = _function(path, "exit")
    if not start <= address < end or exit_function is None:
        return None
    low = start + exit_function[0]
    high = low + exit_function[1]
    stack = _read(pid, sp, 8 * _STACK_WORDS)
    returns = (int.from_bytes(stack[i : i + 8], "little") for i in range(0, len(stack) - 7, 8))
    return HeldLock(address, "libc") if any(low < r <= high for r in returns) else None


def stuck_on(pid: int, libc_too: bool = False) -> HeldLock | None:
    """The lock that `pid`, of one thread, waits on for good, held by a thread it does not
    have, or None.  `libc_too`: a lock of the C library's in exit() as well, for a child
    forked while Frida's agent loaded or unloaded (a lock of the C library's held at any
    other fork was held by the program itself, which would hang natively as well)."""
    stat = proc_stat(pid)
    if stat is None or stat[17] != "1":
        return None
    if stat[0] == "S":
        wait = _futex_wait(pid)
        if wait is None:
            return None
        held = _mutex_held_elsewhere(pid, *wait)
        if held is None and libc_too:
            held = _libc_lock_in_exit(pid, *wait)
        return held
    if stat[0] != "R" or not _stop(pid):
        return None
    try:
        lock = _spin_lock(pid, pt.getregs(pid))
        if lock is None or _read(pid, lock, 4) in (b"", b"\0\0\0\0"):
            return None
        return HeldLock(lock)
    except OSError:
        return None
    finally:
        _let_go(pid)


def waits_in_frida(pid: int) -> bool:
    """Whether `pid`, a forked child, waits in Frida's code: its first thread (the one that
    forked) asleep in a system call made by Frida's agent, or by the C library called from
    it (Frida's other threads in it may spin or sleep).  Such a child has run none of the
    program's code since its fork(): Frida's recovery from the fork() holds it until Frida
    reports it, or, one whose take-up failed, for good."""
    stat = proc_stat(pid)
    if stat is None or stat[0] != "S":
        return False
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    if len(fields) != 9:
        return False
    sp, pc = int(fields[7], 16), int(fields[8], 16)
    path = _code_of(_mappings(pid), pc)
    if path is None:
        return False
    if "frida-agent" in path:
        return True
    return Path(path).name.startswith(("libc.so", "libc-")) and _called_from_agent(pid, sp)


def _write(pid: int, address: int, data: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(address)
            mem.write(data)
        return True
    except OSError:
        return False


def _release_asleep(pid: int, lock: HeldLock) -> bool:
    """Unlock `lock`, which `pid` sleeps on, as its owner would, and wake it: stopped, the
    kernel restarts its wait as it goes on, which then finds the lock free and takes it."""
    if not _stop(pid):
        return False
    try:
        regs = pt.getregs(pid)
        if regs["orig_rax"] != _SYS_FUTEX or regs["rdi"] != lock.address:
            return False
        if lock.kind == "libc":  # a bare lock word
            word = int.from_bytes(_read(pid, lock.address, 4) or b"\0", "little")
            return word == _LOCKED_WITH_WAITERS and _write(pid, lock.address, b"\0\0\0\0")
        mutex = _mutex(pid, lock.address)
        if mutex is None or mutex[0] != _LOCKED_WITH_WAITERS or mutex[2] in (0, pid):
            return False
        users = mutex[3]
        free = b"".join(x.to_bytes(4, "little") for x in (0, 0, 0, max(users - 1, 0)))
        return _write(pid, lock.address, free)
    except OSError:
        return False
    finally:
        _let_go(pid)


def release(pid: int, lock: HeldLock) -> bool:
    """Clear `lock` in `pid`: the thread waiting on it takes it at its next try."""
    if lock.kind == "spin":
        return _write(pid, lock.address, b"\0\0\0\0")
    return _release_asleep(pid, lock)


def free_if_stuck(pid: int, libc_too: bool = False) -> bool:
    """If `pid` waits for good on a lock a thread it does not have holds (stuck_on): release
    it, True."""
    lock = stuck_on(pid, libc_too)
    return lock is not None and release(pid, lock)


class ForksUnderFrida:
    """The children `pid` forks from `__init__` (call it before Frida attaches) on, freed
    when they wait for good on an inherited lock of Frida's (stuck_on).

    The riskiest children are forked while Frida's threads are busy: while the agent and
    our script load (until `attached()`) and while they unload (from `detaching()` until
    `settle()` sees the agent gone).  With child gating on, the children forked between
    `attached(follow_new=False)` and `detaching()` are left alone: Frida ptraces them to
    inject its agent, and a second tracer would break that.  A child alive as `detaching()`
    is called was forked before: it is not at risk for being alive then."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._before = children(pid)
        self._watched: dict[int, int] = {}
        self._risky: set[int] = set()
        self._follow_new = True
        #: pid -> start time of the children alive as the detach began
        self._alive_at_detach: dict[int, int] | None = None
        self.freed: list[int] = []  #: released once, and went on
        self.stuck: list[int] = []  #: waiting on a lock again after its release
        self._released: dict[int, set[HeldLock]] = {}  #: child -> the locks released in it

    def attached(self, follow_new: bool) -> None:
        self._refresh()
        self._risky = set(self._watched)
        self._follow_new = follow_new

    def detaching(self) -> None:
        self._follow_new = True
        self._alive_at_detach = children(self.pid)

    def _refresh(self) -> None:
        if self._follow_new:
            for kid, start in children(self.pid).items():
                if (
                    self._before.get(kid) != start
                    and kid not in self._watched
                    and not _shares_memory(self.pid, kid)
                ):
                    self._watched[kid] = start
                    if (
                        self._alive_at_detach is not None
                        and self._alive_at_detach.get(kid) != start
                    ):
                        self._risky.add(kid)
        for kid, start in list(self._watched.items()):
            stat = proc_stat(kid)
            if stat is None or int(stat[19]) != start or stat[0] in "ZX":
                del self._watched[kid]

    def free_stuck(self) -> None:
        self._refresh()
        for kid in sorted(self._watched.keys() - set(self.stuck)):
            lock = stuck_on(kid, libc_too=kid in self._risky)
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
