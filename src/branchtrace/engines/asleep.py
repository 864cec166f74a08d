"""Letting go of the threads that sleep in a system call at the end of an attached
recording.

A thread leaves Stalker at the next block it runs once the recording has ended, but one
asleep in a system call (a server waiting for input) runs none until it wakes: Frida kept
its agent loaded until then, and the ring stayed mapped in the process, which could not be
recorded again meanwhile ("already traced").  The host stops each such thread as a
debugger would (PTRACE_SEIZE, PTRACE_INTERRUPT) and finds it in one of two places:

- On Stalker's copy of a `syscall` instruction, with the program's own registers (Gum
  restores them all before it); the agent notes the program's address of every system call
  a thread enters.  The host points the thread past the program's own `syscall` and lets
  it go: the kernel restarts the interrupted call there, natively (it steps back over the
  instruction for every -ERESTART* code, as after any ptrace stop), or, if the call had
  just returned, the thread goes on after it.
- In the program's own code, having never run a block under Stalker since it went to
  sleep (asleep since before the attach): nothing to move, and nothing of Stalker's or the
  agent's on its stack, so the agent may let go of its ring.

Some calls a stop ends with EINTR instead of restarting them (man 7 signal, "Interruption
of system call and library functions by stop signals": epoll_wait(), semop(),
sigtimedwait(), socket calls under a timeout).  The host reads which call a thread sleeps
in from /proc before it stops it.  One that waits without a time limit (an idle server in
epoll_wait(..., -1)) it restarts itself: at the stop, the call has returned -EINTR and
nothing else (no event is taken, no semaphore changed), and the thread is pointed back at
the `syscall` with the call's number in rax, its arguments still in their registers, as
the kernel restarts a call; since it is traced from before the check, no signal can have
reached the program unseen meanwhile (one that did is let through, with its EINTR).  One
with a time limit is left alone: it wakes within it.

Anything else (a thread inside a call that Stalker's code or the agent made, one asleep in
a timed call of those) is left as it was, and keeps the agent until it wakes.

A thread moved out of Stalker also gives back the signal stack the agent armed in it (for
a FAULT on a stack overflow, arm_altstack in stalker_agent.c), which only the thread itself
can change: stopped, it makes the sigaltstack() call, at the program's own `syscall`
instruction, and is put back as it was.  Otherwise the program would go on with a signal
stack it never set, on which its SA_ONSTACK handlers would run.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import ptrace as pt

SYSCALL = b"\x0f\x05"
#: calls that a stop ends with EINTR, whatever SA_RESTART says: epoll_wait, epoll_pwait,
#: epoll_pwait2, semop, semtimedop, rt_sigtimedwait; each with where its time limit is: the
#: argument (1-based) and whether it is a timespec pointer (NULL: none) or milliseconds
#: (negative: none), or None for semop, which has none
EINTR_AFTER_STOP: dict[int, tuple[int, bool] | None] = {
    232: (4, False),
    281: (4, False),
    441: (4, True),
    65: None,
    220: (4, True),
    128: (3, True),
}
EINTR = 4
#: calls on the fd in their first argument that a stop ends with EINTR when it is a socket
#: with a receive or send timeout (SO_RCVTIMEO, SO_SNDTIMEO): read, write, readv, writev,
#: connect, accept, sendto, recvfrom, sendmsg, recvmsg, accept4, recvmmsg, sendmmsg
SOCKET_CALLS = {0, 1, 19, 20, 42, 43, 44, 45, 46, 47, 288, 299, 307}
#: how much of a native thread's stack is searched for addresses of Frida's code
STACK_SCAN = 1 << 20
#: how far before Stalker's copy of a `syscall` the agent's store of its address may be
#: (the close, close_range, execve, execveat and exit checks with their callouts, and Gum's
#: clone check, measured at 710 bytes in all, then the sigaltstack and rt_sigaction checks,
#: a check and a callout each)
NOTE_REACH = 2048

MOVED, NATIVE = "moved", "native"
SIGALTSTACK = 131
SS_DISABLE = 2
STACK_T = struct.Struct("<QiiQ")  #: ss_sp, ss_flags (and padding), ss_size
#: what a ptrace stop does to the call a thread sleeps in (_after_a_stop)
RESTARTED, REDO, INTERRUPTED = "restarted", "redo", "interrupted"


def let_go(
    pid: int,
    tid: int,
    syscall_address: Callable[[], int | None],
    done: Callable[[str, bool], bool],
    signal_stack: Callable[[], int | None] = lambda: None,
    wait: float = 2.0,
) -> bool:
    """Let go of thread `tid` of process `pid`, asleep in a system call since the recording
    ended: `syscall_address()` is the program's address of the last system call the
    thread entered under Stalker (asked with the thread stopped), `signal_stack()` the
    agent's signal stack armed in it, and `done(MOVED, disarmed)` or `done(NATIVE, False)`
    tells the agent what was found and done, with the thread still stopped (`disarmed`:
    that signal stack is the thread's no more).  Whether the thread is out of Stalker's
    code.

    ptrace requests must come from the thread that attached, so all of it runs in a thread
    of its own; one that cannot be stopped within `wait` s (an uninterruptible sleep) is let
    go untouched as soon as it stops."""
    outcome: list[bool] = []
    late = threading.Event()
    worker = threading.Thread(
        target=lambda: outcome.append(_let_go(pid, tid, syscall_address, done, signal_stack, late)),
        name=f"bt-let-go-{tid}",
        daemon=True,
    )
    worker.start()
    worker.join(wait)
    if not outcome:
        late.set()
        worker.join(0.5)
    return bool(outcome and outcome[0])


def _let_go(
    pid: int,
    tid: int,
    syscall_address: Callable[[], int | None],
    done: Callable[[str, bool], bool],
    signal_stack: Callable[[], int | None],
    late: threading.Event,
) -> bool:
    if _after_a_stop(pid, tid)[0] == INTERRUPTED:
        return False
    try:
        pt.call(pt.PTRACE_SEIZE, tid)
    except OSError:  # gone, or traced by another
        return False
    pending = 0  # a signal that arrived meanwhile, delivered as the thread goes
    try:
        # traced from here on: a signal now stops the thread before any handler runs
        verdict, number = _after_a_stop(pid, tid)
        if verdict == INTERRUPTED:
            return False
        pt.call(pt.PTRACE_INTERRUPT, tid)
        while True:
            _, status = os.waitpid(tid, pt.WALL)
            if not os.WIFSTOPPED(status):
                return False  # it ended
            event = status >> 16
            if event == pt.EVENT_STOP:
                break
            if event == 0:  # a signal's delivery stop: the signal goes on with the thread
                pending = os.WSTOPSIG(status)
                break
        if late.is_set():
            return False
        regs = pt.getregs(tid)
        # the stop ended the call with EINTR, and no signal came: the call is made again
        redo = (
            verdict == REDO
            and not pending
            and regs.orig_rax == number
            and regs.rax == (-EINTR) & (2**64 - 1)
        )
        maps = _Maps(pid)
        if maps.is_frida(regs.rip):
            address = syscall_address()
            if address is None or not _on_stalkers_copy_of(pid, maps, regs.rip, address):
                return False
            stack = signal_stack()
            disarmed = stack is not None and _disarm_signal_stack(pid, tid, regs, address, stack)
            regs.rip = address if redo else address + len(SYSCALL)
            if redo:
                regs.rax = number
            pt.setregs(tid, regs)
            done(MOVED, disarmed)
            return True
        if maps.path(regs.rip).startswith("/") and not _stack_refers_to_frida(pid, maps, regs.rsp):
            if redo:
                if _read(pid, regs.rip - len(SYSCALL), len(SYSCALL)) != SYSCALL:
                    return False
                regs.rip -= len(SYSCALL)
                regs.rax = number
                pt.setregs(tid, regs)
            done(NATIVE, False)
            return True
        return False
    except Exception:  # a ptrace error, or the agent not answering: the thread stays as it was
        return False
    finally:
        with contextlib.suppress(OSError):
            pt.call(pt.PTRACE_DETACH, tid, 0, pending)


def _disarm_signal_stack(pid: int, tid: int, regs: pt.Regs, syscall_at: int, stack: int) -> bool:
    """Disarm the agent's signal stack `stack` in thread `tid`, stopped with registers
    `regs`: the thread calls sigaltstack() at the program's `syscall` at `syscall_at`, with
    its arguments below its stack's red zone.  Its registers and that memory are put back
    after (the caller sets the registers it goes on with).  A stack of the program's set
    since stays.  Whether the agent's was disarmed."""
    scratch = (regs.rsp - 128 - 2 * STACK_T.size) & ~15
    old_at = scratch + STACK_T.size
    try:
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            fd = mem.fileno()
            saved = os.pread(fd, 2 * STACK_T.size, scratch)
            os.pwrite(fd, STACK_T.pack(0, SS_DISABLE, 0, 0) + bytes(STACK_T.size), scratch)
            try:
                with pt.signals_blocked(tid):  # a signal would stop it ahead of the call
                    result = pt.syscall_at(pid, tid, regs, syscall_at, SIGALTSTACK, scratch, old_at)
                    old = STACK_T.unpack(os.pread(fd, STACK_T.size, old_at))
                    if result == 0 and old[0] != stack and not old[1] & SS_DISABLE:
                        os.pwrite(fd, STACK_T.pack(*old), scratch)  # the program's: put back
                        pt.syscall_at(pid, tid, regs, syscall_at, SIGALTSTACK, scratch, 0)
            finally:
                os.pwrite(fd, saved, scratch)
                pt.setregs(tid, regs)
    except (OSError, struct.error):
        return False
    return result == 0 and old[0] == stack


def _after_a_stop(pid: int, tid: int) -> tuple[str, int]:
    """What a ptrace stop does to the system call thread `tid` sleeps in, and its number:
    RESTARTED, the kernel makes it again as if nothing happened (or the thread is in no
    call); REDO, it fails with EINTR but waits without a time limit, so the host may make
    it again; INTERRUPTED, it fails with EINTR (or the call is not known)."""
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split()
    except OSError:
        return INTERRUPTED, -1
    if not fields or not fields[0].isdigit():  # running, or not in a system call
        return (RESTARTED if fields[:1] == ["-1"] else INTERRUPTED), -1
    number = int(fields[0])
    if number in EINTR_AFTER_STOP:
        limit = EINTR_AFTER_STOP[number]
        if limit is None:
            return REDO, number
        value = int(fields[limit[0]], 16)
        unlimited = value == 0 if limit[1] else bool(value & 0x80000000)
        return (REDO if unlimited else INTERRUPTED), number
    if number in SOCKET_CALLS and _socket_with_timeout(pid, int(fields[1], 16)):
        return INTERRUPTED, number
    return RESTARTED, number


def _read(pid: int, address: int, size: int) -> bytes:
    """`size` bytes of process `pid` at `address`, or b"" if they cannot be read."""
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            return os.pread(mem.fileno(), size, address)
    except OSError:
        return b""


def _socket_with_timeout(pid: int, fd: int) -> bool:
    """Whether fd `fd` of process `pid` is a socket with a receive or send timeout (or
    could not be told apart from one)."""
    try:
        if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
            return False
        pidfd = os.pidfd_open(pid)
    except OSError:
        return True
    try:
        copy = pt.libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
        if copy < 0:
            return True
        try:
            sock = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)
            return True
        try:
            return any(
                sock.getsockopt(socket.SOL_SOCKET, option, 16) != bytes(16)
                for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO)
            )
        finally:
            sock.detach()
            os.close(copy)
    finally:
        os.close(pidfd)


class _Maps:
    """The process's mappings: where Frida's code may be (executable memory that is
    anonymous, Stalker's code and the agent's compiled C, or Frida's agent, a memfd)."""

    def __init__(self, pid: int) -> None:
        self.rows: list[tuple[int, int, str, str]] = []
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            self.rows.append((lo, hi, fields[1], fields[5] if len(fields) == 6 else ""))
        frida = [(lo, hi) for lo, hi, perms, path in self.rows if self._frida(perms, path)]
        self.frida_starts = np.array([lo for lo, _ in frida], np.uint64)
        self.frida_ends = np.array([hi for _, hi in frida], np.uint64)

    @staticmethod
    def _frida(perms: str, path: str) -> bool:
        return "x" in perms and (path == "" or path.startswith("/memfd:"))

    def row(self, address: int) -> tuple[int, int, str, str] | None:
        return next((r for r in self.rows if r[0] <= address < r[1]), None)

    def path(self, address: int) -> str:
        row = self.row(address)
        return row[3] if row else ""

    def is_frida(self, address: int) -> bool:
        row = self.row(address)
        return row is not None and self._frida(row[2], row[3])

    def frida_addresses(self, words: np.ndarray) -> bool:
        """Whether any of `words` points into Frida's code."""
        if not self.frida_starts.size:
            return False
        i = np.searchsorted(self.frida_starts, words, side="right") - 1
        ok = i >= 0
        return bool(np.any(ok & (words < self.frida_ends[np.maximum(i, 0)])))


def _on_stalkers_copy_of(pid: int, maps: _Maps, rip: int, address: int) -> bool:
    """The thread stopped right after a `syscall` of Stalker's that is the copy of the
    program's `syscall` at `address` (in a file the program mapped, not Frida's agent):
    the code compiled for the thread stores `address` shortly before that copy
    (put_syscall_checks in stalker_agent.c), and that store must be there.  Code of the
    program's own in anonymous memory (a JIT) making a system call natively is not moved."""
    row = maps.row(rip)
    if row is None or not maps.path(address).startswith("/"):
        return False
    start = max(rip - NOTE_REACH, row[0])
    before, there = _read(pid, start, rip - start), _read(pid, address, 2)
    low, high = (address & 0xFFFFFFFF).to_bytes(4, "little"), (address >> 32).to_bytes(4, "little")
    note = b"\xc7\x01" + low + b"\xc7\x41\x04" + high  # mov dword [rcx], ...; [rcx+4], ...
    return before.endswith(SYSCALL) and there == SYSCALL and note in before


def _stack_refers_to_frida(pid: int, maps: _Maps, rsp: int) -> bool:
    """Whether the used part of the stack at `rsp` (up to STACK_SCAN bytes) holds an address
    of Frida's code: a return address if the thread is in a call Stalker's code or the
    agent made, but a stale value may say so too, which only keeps the thread as it is."""
    row = maps.row(rsp)
    if row is None:
        return True
    size = min(row[1] - rsp, STACK_SCAN) & ~7
    data = _read(pid, rsp, size)
    if not data:  # unreadable: taken for one that does
        return True
    return maps.frida_addresses(np.frombuffer(data[: len(data) & ~7], np.uint64))
