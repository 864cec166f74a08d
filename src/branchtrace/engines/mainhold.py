"""Holding a process's main thread in a stub of ours while Frida attaches, so that its vector
registers come out of the attach as they went in.

Frida's injector loads the agent by stopping the main thread wherever it is and running its
loader there, which calls the C library's `pthread_create()`; it puts back the general
registers only, and glibc's `pthread_create()` uses xmm/ymm registers: a main thread that
computed with them at that moment went on with whatever the loader left (`vecfork`, attached:
1 round in 1 changed at each attach).  So before Frida comes in, the recorder stops the main
thread itself (ptrace), keeps its whole register state (XSAVE image and general registers),
and sends it to a stub in a page of its own: the stub waits (select() for 1 ms at a time,
which leaves the thread's restart block alone) until the recorder says Frida is done, then
puts the XSAVE image back (XRSTOR), the general registers it used, and jumps back where the
thread was, restarting the system call it was in as the kernel would have.  Frida's
injector stops the thread inside the stub instead, and what its loader changes is thrown
away.  The stub lets go by itself when the recorder is gone (kill(pid, 0) says ESRCH) or
after about 30 s, with the state it kept, which is still the thread's own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time

from . import ptrace
from .forkwindow import proc_stat

PTRACE_GETREGSET = 0x4204
NT_X86_XSTATE = 0x202
ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK = 512, 513, 514, 516
SYS_RESTART_SYSCALL, SYS_MMAP = 219, 9

# as hold.S, assembled with GNU as (intel syntax):
#   wait:       mov rcx, [rip+flag]; jrcxz check_host; jmp release
#   check_host: mov eax, 62 (kill); mov rdi, [rip+host_pid]; mov esi, 0; syscall
#               lea rcx, [rax+3]; jrcxz release                 ; -ESRCH: the recorder is gone
#               mov rcx, [rip+countdown]; lea rcx, [rcx-1]; mov [rip+countdown], rcx
#               jrcxz release
#               mov qword [rip+tv_usec], 1000; mov eax, 23 (select); mov edi, 0; mov esi, 0
#               mov edx, 0; mov r10d, 0; lea r8, [rip+tv_sec]; syscall; jmp wait
#   release:    mov eax, -1; mov edx, -1; xrstor64 [rip+area]
#               mov rax/rcx/rdx/rsi/rdi/r8/r10/r11, [rip+s_...]
#               mov qword [rip+done], 1; jmp [rip+target]
# No instruction of it changes the flags (lea, mov, jrcxz; syscall gives them back), and
# it never touches the stack: the program's red zone stays as it was.
STUB = bytes.fromhex(
    "488b0df9010000e302eb5db83e000000488b3d01020000be000000000f05488d4803e344488b0df5"
    "010000488d49ff48890dea010000e33048c705ed010000e8030000b817000000bf00000000be0000"
    "0000ba0000000041ba000000004c8d05c40100000f05eb98b8ffffffffbaffffffff480fae2d8603"
    "0000488b05b7010000488b0db8010000488b15b9010000488b35ba010000488b3dbb0100004c8b05"
    "bc0100004c8b15bd0100004c8b1dbe01000048c7054b01000001000000ff254d010000"
)
FLAG, DONE, TARGET, HOST_PID, COUNTDOWN, TV_SEC, TV_USEC = (0x200 + 8 * i for i in range(7))
SAVED = ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r10", "r11")  # from 0x238 on, in order
SAVED_AT = 0x238
AREA = 0x400  #: the XSAVE image: XRSTOR wants it 64-byte aligned
COUNTDOWN_ROUNDS = 30_000  #: rounds of 1 ms before the stub lets go by itself


class MainThreadHold:
    """The main thread of `pid` held in the stub (`take`), until `release`."""

    def __init__(self, pid: int, base: int, size: int) -> None:
        self.pid = pid
        self.base = base
        self.size = size

    @classmethod
    def take(cls, pid: int) -> MainThreadHold | None:
        """Hold the main thread, or None when it cannot be (then Frida attaches as before):
        a process stopped, a main thread gone, another tracer (Frida then says so), no XSAVE,
        or a seccomp filter, which might kill the process for the stub's select() or kill()."""
        stat = proc_stat(pid)
        if stat is None or stat[0] in "TtZXx" or _seccomp(pid) != 0:
            return None
        try:
            ptrace.call(ptrace.PTRACE_SEIZE, pid, 0, 0)
        except OSError:
            return None
        pending: list[int] = []
        try:
            ptrace.call(ptrace.PTRACE_INTERRUPT, pid)
            if not _stopped(pid, pending):
                return None  # a group stop under way (job control): leave it to it
            regs = ptrace.getregs(pid)
            xstate = _xstate(pid)
            gadget = _syscall_instruction(pid)
            if xstate is None or gadget is None:
                return None
            size = (AREA + len(xstate) + 4095) & ~4095
            try:  # read, write, exec; private, anonymous
                with ptrace.signals_blocked(pid):
                    base = ptrace.syscall_at(
                        pid, pid, regs, gadget, SYS_MMAP, 0, size, 7, 0x22, -1, 0
                    )
            finally:
                ptrace.setregs(pid, regs)
            if base < 0:
                return None
            hold = cls(pid, base, size)
            _write(pid, base, hold._page(regs, xstate))
            to_stub = ptrace.Regs.from_buffer_copy(regs)
            to_stub.rip = base
            to_stub.orig_rax = 2**64 - 1  # the stub restarts the call itself: see _page
            ptrace.setregs(pid, to_stub)
            return hold
        except OSError:
            return None
        finally:
            _detach(pid, pending)

    def _page(self, regs: ptrace.Regs, xstate: bytes) -> bytes:
        page = bytearray(self.size)
        page[: len(STUB)] = STUB
        rax, target = regs.rax, regs.rip
        error = -ctypes.c_int64(regs.rax).value
        if ctypes.c_int64(regs.orig_rax).value >= 0:  # stopped in a system call's way out
            if error in (ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND):
                rax, target = regs.orig_rax, regs.rip - 2
            elif error == ERESTART_RESTARTBLOCK:
                rax, target = SYS_RESTART_SYSCALL, regs.rip - 2
        words = {TARGET: target, HOST_PID: os.getpid(), COUNTDOWN: COUNTDOWN_ROUNDS}
        words |= {SAVED_AT + 8 * i: regs.get(name) for i, name in enumerate(SAVED)}
        words[SAVED_AT] = rax
        for at, value in words.items():
            page[at : at + 8] = value.to_bytes(8, "little")
        page[AREA : AREA + len(xstate)] = xstate
        return bytes(page)

    def release(self, timeout: float = 2.0) -> bool | None:
        """Let the thread go on, its registers as they were; whether it did within `timeout`
        (None: the process is gone)."""
        with contextlib.suppress(OSError):
            _write(self.pid, self.base + FLAG, (1).to_bytes(8, "little"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if _read(self.pid, self.base + DONE, 8) != bytes(8):
                    return True
            except OSError:
                return None
            time.sleep(0.001)
        return False


def _stopped(tid: int, pending: list[int]) -> bool:
    """Wait for the interrupt's stop; a signal that comes first is kept in `pending` to be
    given back at the detach.  False for a group stop."""
    while True:
        _, status = os.waitpid(tid, ptrace.WALL)
        if not os.WIFSTOPPED(status):
            raise OSError("the main thread ended")
        sig, event = os.WSTOPSIG(status), status >> 16
        if event == ptrace.EVENT_STOP:
            return sig == signal.SIGTRAP
        pending.append(sig)  # a signal-delivery stop: the interrupt's comes next
        ptrace.call(ptrace.PTRACE_INTERRUPT, tid)
        ptrace.call(ptrace.PTRACE_CONT, tid, 0, 0)


def _seccomp(pid: int) -> int:
    """The main thread's seccomp mode (0: none), -1 when unknown."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Seccomp:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1


def _detach(tid: int, pending: list[int]) -> None:
    with contextlib.suppress(OSError):
        ptrace.call(ptrace.PTRACE_DETACH, tid, 0, pending[0] if pending else 0)
    for sig in pending[1:]:
        ptrace.tgkill(tid, tid, sig)


def _xstate(tid: int) -> bytes | None:
    buf = ctypes.create_string_buffer(64 * 1024)
    iov = (ctypes.c_uint64 * 2)(ctypes.addressof(buf), len(buf))
    try:
        ptrace.call(PTRACE_GETREGSET, tid, NT_X86_XSTATE, ctypes.addressof(iov))
    except OSError:
        return None
    return buf.raw[: iov[1]]


def _syscall_instruction(pid: int) -> int | None:
    """An address holding the bytes of `syscall` in executable memory (the vDSO's first)."""
    with open(f"/proc/{pid}/maps") as maps:
        ranges = [line.split() for line in maps]
    ranges.sort(key=lambda f: f[-1] != "[vdso]")
    for fields in ranges:
        if fields[1][2] != "x" or fields[-1] in ("[vsyscall]",):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        try:
            code = _read(pid, lo, min(hi - lo, 1 << 20))
        except OSError:
            continue
        at = code.find(b"\x0f\x05")
        if at >= 0:
            return lo + at
    return None


def _read(pid: int, address: int, n: int) -> bytes:
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        return os.pread(fd, n, address)
    finally:
        os.close(fd)


def _write(pid: int, address: int, data: bytes) -> None:
    fd = os.open(f"/proc/{pid}/mem", os.O_WRONLY)
    try:
        os.pwrite(fd, data, address)
    finally:
        os.close(fd)
