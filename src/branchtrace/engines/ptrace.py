"""ptrace through ctypes: the requests, the register file, and starting a program stopped
at its exec (shared by the step engine and the xol and uprobe probe engines)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from ..errors import LaunchError
from .base import USERS_FILE_LIMIT

libc = ctypes.CDLL(None, use_errno=True)
_ptrace = libc.ptrace
_ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_ptrace.restype = ctypes.c_long

PTRACE_TRACEME, PTRACE_PEEKTEXT, PTRACE_PEEKUSER, PTRACE_POKETEXT = 0, 1, 3, 4
PTRACE_CONT, PTRACE_SINGLESTEP, PTRACE_GETREGS, PTRACE_SETREGS = 7, 9, 12, 13
PTRACE_DETACH = 17
PTRACE_SETOPTIONS, PTRACE_GETEVENTMSG, PTRACE_GETSIGINFO = 0x4200, 0x4201, 0x4202
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
PTRACE_GETSIGMASK, PTRACE_SETSIGMASK = 0x420A, 0x420B
O_TRACEFORK, O_TRACEVFORK, O_TRACECLONE, O_TRACEEXEC, O_TRACEEXIT = 0x2, 0x4, 0x8, 0x10, 0x40
O_EXITKILL = 0x100000
EVENT_FORK, EVENT_VFORK, EVENT_CLONE, EVENT_EXEC, EVENT_EXIT, EVENT_STOP = 1, 2, 3, 4, 6, 128
SI_KERNEL = 0x80  #: si_code of a signal the kernel sends: the SIGTRAP after an int3 (a single
#: step gives TRAP_TRACE), the SIGSEGV when a signal frame finds no room on the stack
WALL = 0x40000000  #: waitpid's __WALL: threads too
SYS_TGKILL = 234

_REGISTERS = "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags"
_REGISTERS += " rsp ss fs_base gs_base ds es fs gs"  # struct user_regs_struct, in order
RIP_OFFSET = _REGISTERS.split().index("rip") * 8  #: for PTRACE_PEEKUSER


class Regs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_ulonglong) for name in _REGISTERS.split()]

    def get(self, name: str) -> int:
        return int(getattr(self, name))

    def __getitem__(self, name: str) -> int:
        return int(getattr(self, name))


def call(request: int, tid: int, addr: int = 0, data: int = 0) -> int:
    """One ptrace request; OSError on failure."""
    ctypes.set_errno(0)
    r = _ptrace(request, tid, ctypes.c_void_p(addr), ctypes.c_void_p(data))
    if r == -1 and ctypes.get_errno():
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return int(r)


def getregs(tid: int) -> Regs:
    regs = Regs()
    call(PTRACE_GETREGS, tid, 0, ctypes.addressof(regs))
    return regs


def setregs(tid: int, regs: Regs) -> None:
    call(PTRACE_SETREGS, tid, 0, ctypes.addressof(regs))


def syscall_at(pid: int, tid: int, regs: Regs, at: int, number: int, *args: int) -> int:
    """Have stopped thread `tid` of process `pid` make system call `number` with `args` at
    the `syscall` instruction at `at` (a single step), registers `regs` otherwise, and stop
    again after it: its result (the caller puts its registers back).  A signal that comes
    first is sent again, to be delivered once the thread goes, and the call is not made
    (OSError)."""
    making = Regs.from_buffer_copy(regs)
    making.rip, making.rax, making.orig_rax = at, number, 2**64 - 1  # no call to restart
    for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args, strict=False):
        setattr(making, name, value & (2**64 - 1))
    setregs(tid, making)
    call(PTRACE_SINGLESTEP, tid)
    _, status = os.waitpid(tid, WALL)
    if not os.WIFSTOPPED(status):
        raise OSError(f"thread {tid} ended")
    after = getregs(tid)
    sig = os.WSTOPSIG(status)
    if sig != signal.SIGTRAP or status >> 16 or after.rip != at + 2:
        if sig != signal.SIGTRAP and not status >> 16:
            tgkill(pid, tid, sig)
        raise OSError(f"thread {tid} stopped elsewhere")
    return int.from_bytes(after.rax.to_bytes(8, "little"), "little", signed=True)


@contextlib.contextmanager
def signals_blocked(tid: int) -> Iterator[None]:
    """Stopped thread `tid` with every signal blocked inside, its own mask back after: a
    signal sent meanwhile stays pending, to be delivered as the thread goes on, instead of
    stopping it ahead of a system call syscall_at() makes it make.  Under a program's 1 kHz
    timer a signal came first in 6 of 10 attempts of the main thread's hold (mainhold.py), in
    20 of 20 under a 5 kHz one: finding the `syscall` and reading the registers took longer
    than the timer's period."""
    mask = ctypes.c_uint64()
    call(PTRACE_GETSIGMASK, tid, ctypes.sizeof(mask), ctypes.addressof(mask))
    every = ctypes.c_uint64(2**64 - 1)  # the kernel leaves SIGKILL and SIGSTOP out
    call(PTRACE_SETSIGMASK, tid, ctypes.sizeof(every), ctypes.addressof(every))
    try:
        yield
    finally:
        call(PTRACE_SETSIGMASK, tid, ctypes.sizeof(mask), ctypes.addressof(mask))


def siginfo(tid: int) -> tuple[int, int, int]:
    """(si_code, si_pid, si_addr) of the signal the thread is stopped with: si_pid is
    meaningful for a signal a process sent, si_addr for a fault."""
    info = ctypes.create_string_buffer(128)
    call(PTRACE_GETSIGINFO, tid, 0, ctypes.addressof(info))
    raw = info.raw
    return (
        int.from_bytes(raw[8:12], "little", signed=True),
        int.from_bytes(raw[16:20], "little", signed=True),
        int.from_bytes(raw[16:24], "little"),
    )


def trap_code(tid: int) -> int:
    """si_code of the SIGTRAP the thread is stopped with."""
    return siginfo(tid)[0]


def tgkill(pid: int, tid: int, sig: int) -> int:
    return int(libc.syscall(SYS_TGKILL, pid, tid, sig))


def _traceme() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, USERS_FILE_LIMIT)
    _ptrace(PTRACE_TRACEME, 0, None, None)


def spawn_stopped(program: Path, argv: tuple[str, ...]) -> subprocess.Popen[bytes]:
    """Start `program` with `argv[1:]`, traced and stopped at its exec: nothing of it ran."""
    try:
        child = subprocess.Popen([str(program), *argv[1:]], preexec_fn=_traceme, close_fds=True)
    except OSError as e:
        raise LaunchError(f"{argv[0]}: cannot start: {e.strerror}") from None
    _, status = os.waitpid(child.pid, WALL)
    if not os.WIFSTOPPED(status):
        child.returncode = os.waitstatus_to_exitcode(status)
        raise LaunchError(f"{argv[0]}: ended before it could be traced")
    return child
