"""The xol probe engine: breakpoints over ptrace, the displaced instruction run out of line.

The design of the seed (User Space Breakpoint Assistance): an `int3` replaces the first
byte of the probed instruction.  When a thread hits it, the tracer records the hit and then
runs the displaced instruction without ever removing the breakpoint (so other threads keep
hitting it), in one of these ways, chosen per instruction:

* **emulated**: control transfers (call, jmp, jcc, ret, loop) are always emulated: their
  effect is computed from the registers and written back, no slot, no second trap.  With
  `--displaced auto` the simplest instructions (push reg, mov reg,reg, nop, endbr64) are
  emulated as well.
* **boosted**: the instruction is copied into a slot of an XOL page mapped into the probed
  process, followed by a jump back to the instruction after the probe; the thread continues
  in the slot, no second trap.  XOL pages are placed within 2 GB of the probed module so a
  rip-relative operand only needs its displacement adjusted.
* **stepped** (`--displaced step`): the same slot, single-stepped, rip moved back after it.
* **inline** (`--displaced inline`, the `--inline-step` of the docs): the original byte is
  put back, the thread single-steps it in place, the breakpoint is re-inserted.  Unsafe with
  threads (another thread can run through the probe while it is out): only on request.

Return probes replace the return address with a trampoline (an int3 in the XOL page) and
keep the real one on a per-thread stack; entries a longjmp skipped are dropped when an
outer frame returns.  On Ctrl-C every thread is stopped, threads inside a slot are stepped
out of it, return addresses and code bytes are restored, the XOL pages are unmapped and
the process is let go, running.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from capstone import CS_ARCH_X86, CS_MODE_64, CS_OP_IMM, CS_OP_MEM, CS_OP_REG, Cs
from capstone import x86 as cx86

from ..engines import ptrace as pt
from ..engines.base import Target
from ..engines.stalker import resolve_program
from ..errors import (
    AlreadyTracedError,
    EngineUnavailableError,
    LaunchError,
    NoSuchProcessError,
    PermissionDeniedError,
)
from .base import Hit, ProbeResult, fetch_value
from .spec import ProbePoint, ProbeSpecError

_CHILD_KIND = {pt.EVENT_CLONE: "thread", pt.EVENT_FORK: "fork", pt.EVENT_VFORK: "vfork"}
_OPTIONS = pt.O_TRACECLONE | pt.O_TRACEEXEC | pt.O_TRACEFORK | pt.O_TRACEVFORK
_SYS_MMAP, _SYS_MUNMAP = 9, 11
_PROT_RX = 0x1 | 0x4
_MAP_PRIVATE_ANON_NOREPLACE = 0x02 | 0x20 | 0x100000
_XOL_PAGE = 4096
_SLOT = 32  #: bytes per slot: an instruction (<= 15) and a 5-byte jump back
_REACH = (1 << 31) - (1 << 20)  #: how far an XOL page may be from the code it serves

DISPLACED = ("auto", "boost", "step", "inline")


# -- instructions --------------------------------------------------------------------------------

_cs = Cs(CS_ARCH_X86, CS_MODE_64)
_cs.detail = True

_FLAG = {"c": 0, "p": 2, "z": 6, "s": 7, "o": 11}


def _condition(mnemonic: str) -> Callable[[int], bool] | None:
    """The predicate over eflags a conditional jump takes its branch on."""

    def bit(f: int, name: str) -> bool:
        return bool(f >> _FLAG[name] & 1)

    table: dict[str, Callable[[int], bool]] = {
        "jo": lambda f: bit(f, "o"),
        "jno": lambda f: not bit(f, "o"),
        "jb": lambda f: bit(f, "c"),
        "jae": lambda f: not bit(f, "c"),
        "je": lambda f: bit(f, "z"),
        "jne": lambda f: not bit(f, "z"),
        "jbe": lambda f: bit(f, "c") or bit(f, "z"),
        "ja": lambda f: not bit(f, "c") and not bit(f, "z"),
        "js": lambda f: bit(f, "s"),
        "jns": lambda f: not bit(f, "s"),
        "jp": lambda f: bit(f, "p"),
        "jnp": lambda f: not bit(f, "p"),
        "jl": lambda f: bit(f, "s") != bit(f, "o"),
        "jge": lambda f: bit(f, "s") == bit(f, "o"),
        "jle": lambda f: bit(f, "z") or bit(f, "s") != bit(f, "o"),
        "jg": lambda f: not bit(f, "z") and bit(f, "s") == bit(f, "o"),
    }
    return table.get(mnemonic)


_GPR32 = {
    "eax": "rax", "ebx": "rbx", "ecx": "rcx", "edx": "rdx", "esi": "rsi", "edi": "rdi",
    "ebp": "rbp", "esp": "rsp", **{f"r{i}d": f"r{i}" for i in range(8, 16)},
}  # fmt: skip
_GPR64 = frozenset(_GPR32.values())


@dataclass
class _Site:
    """One breakpoint: the instruction it displaces and how that instruction is run."""

    address: int
    original: bytes  #: the instruction's bytes
    size: int
    how: str  #: 'emulate', 'boost', 'step', 'inline'
    emulate: (
        Callable[[pt.Regs, Callable[[int, int], bytes | None], Callable[[int, bytes], None]], None]
        | None
    ) = None
    slot: int = 0
    entry: list[int] = field(default_factory=list)  #: probes hit on entry
    returns: list[int] = field(default_factory=list)  #: %return probes armed here
    module_base: int = 0
    text: str = ""


def _analyze(code: bytes, address: int, displaced: str) -> tuple[str, Callable | None, str, object]:  # type: ignore[type-arg]
    """How to run the instruction at `address`: (how, emulator, text, capstone insn)."""
    insns = list(_cs.disasm(code, address, 1))
    if not insns:
        raise ProbeSpecError(f"{address:#x}: cannot decode the instruction there")
    insn = insns[0]
    text = f"{insn.mnemonic} {insn.op_str}".strip()
    nxt = address + insn.size
    m = insn.mnemonic
    ops = insn.operands

    def operand_value(op: object, regs: pt.Regs, read: Callable[[int, int], bytes | None]) -> int:
        if op.type == CS_OP_IMM:  # type: ignore[attr-defined]
            return int(op.imm) & (2**64 - 1)  # type: ignore[attr-defined]
        if op.type == CS_OP_REG:  # type: ignore[attr-defined]
            return regs.get(insn.reg_name(op.reg))  # type: ignore[attr-defined]
        mem = op.mem  # type: ignore[attr-defined]
        addr = mem.disp
        if mem.base == cx86.X86_REG_RIP:
            addr += nxt
        elif mem.base:
            addr += regs.get(insn.reg_name(mem.base))
        if mem.index:
            addr += regs.get(insn.reg_name(mem.index)) * mem.scale
        if mem.segment == cx86.X86_REG_FS:
            addr += regs.fs_base
        elif mem.segment == cx86.X86_REG_GS:
            addr += regs.gs_base
        raw = read(addr & (2**64 - 1), 8)
        if raw is None:
            raise OSError(f"cannot read the operand of {text} at {address:#x}")
        return int.from_bytes(raw, "little")

    if m in ("call", "jmp") and ops and ops[0].type in (CS_OP_IMM, CS_OP_REG, CS_OP_MEM):
        op = ops[0]

        def transfer(regs: pt.Regs, read: Callable, write: Callable) -> None:  # type: ignore[type-arg]
            target = operand_value(op, regs, read)
            if m == "call":
                regs.rsp -= 8
                write(regs.rsp, nxt.to_bytes(8, "little"))
            regs.rip = target

        return "emulate", transfer, text, insn
    if m in ("ret", "retq"):
        pop = int(ops[0].imm) if ops else 0

        def ret(regs: pt.Regs, read: Callable, write: Callable) -> None:  # type: ignore[type-arg]
            raw = read(regs.rsp, 8)
            if raw is None:
                raise OSError(f"cannot read the return address at {regs.rsp:#x}")
            regs.rip = int.from_bytes(raw, "little")
            regs.rsp += 8 + pop

        return "emulate", ret, text, insn
    cond = _condition(m)
    if cond is not None or m in ("jrcxz", "jecxz", "loop", "loope", "loopne"):
        target = int(ops[0].imm)

        def jcc(regs: pt.Regs, read: Callable, write: Callable) -> None:  # type: ignore[type-arg]
            if cond is not None:
                taken = cond(regs.eflags)
            elif m.startswith("j"):
                taken = (regs.rcx if m == "jrcxz" else regs.rcx & 0xFFFFFFFF) == 0
            else:
                regs.rcx = (regs.rcx - 1) & (2**64 - 1)
                zf = bool(regs.eflags >> _FLAG["z"] & 1)
                taken = regs.rcx != 0 and (m == "loop" or zf == (m == "loope"))
            regs.rip = target if taken else nxt

        return "emulate", jcc, text, insn
    groups = set(insn.groups)
    if groups & {cx86.X86_GRP_JUMP, cx86.X86_GRP_CALL, cx86.X86_GRP_RET, cx86.X86_GRP_IRET}:
        raise ProbeSpecError(
            f"{address:#x}: cannot probe {text!r} (a control transfer it cannot emulate)"
        )
    if m == "int3":
        raise ProbeSpecError(f"{address:#x}: there is already a breakpoint there")
    if displaced == "auto":
        emulator = _simple_emulation(insn, nxt)
        if emulator is not None:
            return "emulate", emulator, text, insn
    if displaced == "inline":
        return "inline", None, text, insn
    return ("step" if displaced == "step" else "boost"), None, text, insn


def _simple_emulation(insn: object, nxt: int) -> Callable | None:  # type: ignore[type-arg]
    m, ops = insn.mnemonic, insn.operands  # type: ignore[attr-defined]
    if m in ("nop", "endbr64") or (m == "xchg" and insn.op_str in ("ax, ax",)):  # type: ignore[attr-defined]

        def skip(regs: pt.Regs, read: Callable, write: Callable) -> None:  # type: ignore[type-arg]
            regs.rip = nxt

        return skip
    if m == "push" and len(ops) == 1 and ops[0].type == CS_OP_REG:
        reg = insn.reg_name(ops[0].reg)  # type: ignore[attr-defined]
        if reg in _GPR64:

            def push(regs: pt.Regs, read: Callable, write: Callable) -> None:  # type: ignore[type-arg]
                value = regs.get(reg)
                regs.rsp -= 8
                write(regs.rsp, value.to_bytes(8, "little"))
                regs.rip = nxt

            return push
    if m == "mov" and len(ops) == 2 and ops[0].type == ops[1].type == CS_OP_REG:
        dst, src = (insn.reg_name(o.reg) for o in ops)  # type: ignore[attr-defined]
        wide = dst in _GPR64 and src in _GPR64
        narrow = dst in _GPR32 and src in _GPR32
        if wide or narrow:
            d, s = (_GPR32[dst], _GPR32[src]) if narrow else (dst, src)
            mask = 0xFFFFFFFF if narrow else 2**64 - 1

            def mov(regs: pt.Regs, read: Callable, write: Callable) -> None:  # type: ignore[type-arg]
                setattr(regs, d, regs.get(s) & mask)
                regs.rip = nxt

            return mov
    return None


def _slot_code(insn: object, address: int, slot: int) -> bytes:
    """The instruction relocated to `slot`, followed by a jump back after the original."""
    code = bytearray(insn.bytes)  # type: ignore[attr-defined]
    size = len(code)
    if any(op.type == CS_OP_MEM and op.mem.base == cx86.X86_REG_RIP for op in insn.operands):  # type: ignore[attr-defined]
        off, n = insn.disp_offset, insn.disp_size  # type: ignore[attr-defined]
        disp = int.from_bytes(code[off : off + n], "little", signed=True)
        disp += (address + size) - (slot + size)
        if not -(2**31) <= disp < 2**31:
            raise EngineUnavailableError(f"XOL slot for {address:#x} is out of rip-relative reach")
        code[off : off + n] = disp.to_bytes(n, "little", signed=True)
    back = (address + size) - (slot + size + 5)
    return bytes(code) + b"\xe9" + back.to_bytes(4, "little", signed=True)


def remote_syscall(tid: int, mem_fd: int, number: int, *args: int) -> int:
    """Make a thread stopped under ptrace run one system call (a `syscall` instruction
    written at its rip, then the code and registers put back); its result."""
    saved = pt.getregs(tid)
    regs = pt.getregs(tid)
    at = saved.rip
    code = os.pread(mem_fd, 2, at)
    os.pwrite(mem_fd, b"\x0f\x05", at)
    regs.rax = number
    for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args, strict=False):
        setattr(regs, name, value & (2**64 - 1))
    regs.orig_rax = 2**64 - 1  # no syscall restart on resume
    pt.setregs(tid, regs)
    signals = []
    try:
        pt.call(pt.PTRACE_SINGLESTEP, tid)
        while True:
            _, status = os.waitpid(tid, pt.WALL)
            if not os.WIFSTOPPED(status):
                raise EngineUnavailableError("the process ended during set-up")
            if os.WSTOPSIG(status) == signal.SIGTRAP:
                break
            signals.append(os.WSTOPSIG(status))  # delivered again once we are done
            pt.call(pt.PTRACE_SINGLESTEP, tid)
        result = pt.getregs(tid).rax
    finally:
        os.pwrite(mem_fd, code, at)
        pt.setregs(tid, saved)
    for sig in signals:
        pt.tgkill(_tgid(tid), tid, sig)
    return result - 2**64 if result >> 63 else result


def _tgid(tid: int) -> int:
    for line in Path(f"/proc/{tid}/status").read_text().splitlines():
        if line.startswith("Tgid:"):
            return int(line.split()[1])
    return tid


# -- the process ---------------------------------------------------------------------------------


@dataclass
class _Task:
    tid: int
    pid: int
    started: bool = False  #: its first stop (attach or creation) was seen
    stepping: _Site | None = None  #: single-stepping this site's instruction
    pending: list[tuple[int, int, _Site]] = field(
        default_factory=list
    )  #: (stack slot, return address, site)
    stop_sent: bool = False
    parked: bool = False  #: stopped for detaching
    kind: str = "main"  #: 'main', 'thread', 'fork', 'vfork'; '' until its creation event


class XolEngine:
    name = "xol"

    def __init__(self, displaced: str = "auto") -> None:
        if displaced not in DISPLACED:
            raise ValueError(displaced)
        self.displaced = displaced

    def run(
        self,
        target: Target,
        points: list[ProbePoint],
        on_hit: Callable[[Hit], None],
        started: Callable[[str], None],
        stop: threading.Event,
    ) -> ProbeResult:
        session = _Session(points, on_hit, stop, self.displaced)
        if target.pid is not None:
            session.attach(target.pid)
            what = f"process {target.pid}"
        else:
            session.spawn(target.argv)
            what = f"{target.argv[0]} (pid {session.pid})"
        how = {
            "auto": "boosted slots, simple instructions emulated",
            "boost": "boosted slots",
            "step": "single-stepped slots",
            "inline": "inline single-step, unsafe with threads",
        }[self.displaced]
        started(
            f"probing {what} at {len(points)} point(s) with the xol engine "
            f"(ptrace breakpoints, {how}); Ctrl-C to stop"
        )
        return session.run()


class _Session:
    def __init__(
        self,
        points: list[ProbePoint],
        on_hit: Callable[[Hit], None],
        stop: threading.Event,
        displaced: str,
    ) -> None:
        self.points = points
        self.on_hit = on_hit
        self.stop = stop
        self.displaced = displaced
        self.pid = 0
        self.child: subprocess.Popen[bytes] | None = None
        self.tasks: dict[int, _Task] = {}
        self.sites: dict[int, _Site] = {}
        self.pages: dict[int, tuple[int, int]] = {}  #: module base -> (page, next free slot)
        self.trampoline = 0
        self.mem_fd = -1
        self.result = ProbeResult(0)
        self.wakers: list[int] = []  #: tids the stop watcher sent SIGSTOP to
        self.lock = threading.Lock()
        self.done = False
        self.stopping = False

    # -- memory --------------------------------------------------------------------------------

    def read(self, address: int, n: int) -> bytes | None:
        try:
            data = os.pread(self.mem_fd, n, address)
        except (OSError, OverflowError):
            return None
        return data if len(data) == n else (data or None)

    def write(self, address: int, data: bytes) -> None:
        os.pwrite(self.mem_fd, data, address)

    # -- starting ------------------------------------------------------------------------------

    def spawn(self, argv: tuple[str, ...]) -> None:
        program = resolve_program(argv[0])
        self.child = pt.spawn_stopped(program, argv)
        self.pid = pid = self.child.pid
        self.result.pid = pid
        pt.call(pt.PTRACE_SETOPTIONS, pid, 0, _OPTIONS)
        self.tasks[pid] = _Task(pid, pid, started=True)
        self.mem_fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
        try:
            # libraries are mapped once the dynamic loader reaches the program's entry point
            self._run_to(pid, self._entry_point(program))
            self._install(pid)
        except BaseException:
            self.child.kill()
            self.child.wait()
            raise

    def _entry_point(self, program: Path) -> int:
        with open(program, "rb") as f:
            head = f.read(64)
        entry = int.from_bytes(head[24:32], "little")
        etype = int.from_bytes(head[16:18], "little")
        if etype == 3:  # ET_DYN: relative to where the executable was mapped
            entry += self._module_base(str(program))
        return entry

    def _module_base(self, path: str) -> int:
        for line in Path(f"/proc/{self.pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5] == path:
                return int(parts[0].split("-")[0], 16) - int(parts[2], 16)
        raise ProbeSpecError(
            f"{Path(path).name} is not loaded in process {self.pid}",
            hint="probes go into the program and the libraries it loads at start-up",
        )

    def _run_to(self, tid: int, address: int) -> None:
        original = self.read(address, 1)
        assert original is not None
        self.write(address, b"\xcc")
        pt.call(pt.PTRACE_CONT, tid)
        _, status = os.waitpid(tid, pt.WALL)
        self.write(address, original)
        if not os.WIFSTOPPED(status) or os.WSTOPSIG(status) != signal.SIGTRAP:
            raise LaunchError("the program ended before reaching its entry point")
        regs = pt.getregs(tid)
        regs.rip = address
        pt.setregs(tid, regs)

    def attach(self, pid: int) -> None:
        if not Path(f"/proc/{pid}").is_dir():
            raise NoSuchProcessError(f"no process with pid {pid}")
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            raise NoSuchProcessError(f"no process with pid {pid}") from None
        tracer = next(
            (ln.split()[1] for ln in status.splitlines() if ln.startswith("TracerPid:")), "0"
        )
        if tracer != "0":
            raise AlreadyTracedError(f"process {pid} is already traced by pid {tracer}")
        self.pid = pid
        self.result.pid = pid
        try:
            self.mem_fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
        except PermissionError:
            raise PermissionDeniedError(
                f"no permission to probe process {pid}", hint="run as root"
            ) from None
        seen: set[int] = set()
        while True:  # threads may start while we attach: repeat until none is new
            tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")} - seen
            if not tids:
                break
            for tid in tids:
                seen.add(tid)
                try:
                    pt.call(pt.PTRACE_SEIZE, tid, 0, _OPTIONS)
                    pt.call(pt.PTRACE_INTERRUPT, tid)
                except OSError as e:
                    if e.errno == 1:
                        raise PermissionDeniedError(
                            f"no permission to trace process {pid}"
                        ) from None
                    continue  # the thread ended meanwhile
                self.tasks[tid] = _Task(tid, pid)
        for tid in list(self.tasks):
            while True:
                try:
                    _, st = os.waitpid(tid, pt.WALL)
                except ChildProcessError:
                    self.tasks.pop(tid)
                    break
                if os.WIFSTOPPED(st) and st >> 16 == pt.EVENT_STOP:
                    self.tasks[tid].started = True
                    break
                if os.WIFSTOPPED(st):  # a signal arrived first: keep it for later
                    pt.call(pt.PTRACE_CONT, tid, 0, os.WSTOPSIG(st))
                    pt.call(pt.PTRACE_INTERRUPT, tid)
                else:
                    self.tasks.pop(tid)
                    break
        if pid not in self.tasks:
            raise NoSuchProcessError(f"process {pid} ended while being attached")
        self._install(pid)

    # -- probes --------------------------------------------------------------------------------

    def _install(self, tid: int) -> None:
        by_address: dict[int, _Site] = {}
        for i, point in enumerate(self.points):
            base = self._module_base(str(point.path))
            address = base + point.vaddr if point.first_vaddr == 0 else point.vaddr
            site = by_address.get(address)
            if site is None:
                code = self.read(address, 16)
                if code is None:
                    raise ProbeSpecError(f"{point.label}: cannot read the code at {address:#x}")
                if (
                    point.instruction
                    and code[: len(point.instruction)][:1] != point.instruction[:1]
                ):
                    raise ProbeSpecError(
                        f"{point.label}: the code in memory differs from {point.path}"
                    )
                how, emulator, text, insn = _analyze(code, address, self.displaced)
                site = _Site(address, bytes(insn.bytes), insn.size, how, emulator, text=text)  # type: ignore[attr-defined]
                site.module_base = base
                if how in ("boost", "step"):
                    site.slot = self._slot(tid, base)
                    self.write(site.slot, _slot_code(insn, address, site.slot))
                by_address[address] = site
            (site.returns if point.is_return else site.entry).append(i)
        if any(p.is_return for p in self.points):
            base = next(iter(by_address.values())).module_base
            self.trampoline = self._slot(tid, base)
            self.write(self.trampoline, b"\xcc")
        for address, site in by_address.items():
            self.write(address, b"\xcc")
            self.sites[address] = site

    def _slot(self, tid: int, module_base: int) -> int:
        for base, (page, used) in self.pages.items():
            if abs(base - module_base) < _REACH and used + _SLOT <= _XOL_PAGE:
                self.pages[base] = (page, used + _SLOT)
                return page + used
        page = self._map_page(tid, module_base)
        self.pages[module_base] = (page, _SLOT)
        return page

    def _map_page(self, tid: int, near: int) -> int:
        """An executable page mapped into the process within reach of `near`."""
        ranges = []
        for line in Path(f"/proc/{self.pid}/maps").read_text().splitlines():
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((lo, hi))
        ranges.sort()
        candidates = []
        for (_, hi), (lo2, _) in itertools.pairwise(ranges):
            if lo2 - hi >= 2 * _XOL_PAGE:
                candidates.append(hi + _XOL_PAGE if lo2 - hi >= 3 * _XOL_PAGE else hi)
        candidates.sort(key=lambda a: abs(a - near))
        for hint in candidates:
            if abs(hint - near) >= _REACH:
                break
            got = self._syscall(
                tid, _SYS_MMAP, hint, _XOL_PAGE, _PROT_RX, _MAP_PRIVATE_ANON_NOREPLACE, -1, 0
            )
            if got == hint:
                return got
        raise EngineUnavailableError("no room for an XOL page within 2 GB of the probed code")

    def _syscall(self, tid: int, number: int, *args: int) -> int:
        return remote_syscall(tid, self.mem_fd, number, *args)

    # -- running -------------------------------------------------------------------------------

    def run(self) -> ProbeResult:
        watcher = threading.Thread(target=self._watch_stop, daemon=True)
        watcher.start()
        try:
            for tid, task in list(self.tasks.items()):
                if task.started:
                    pt.call(pt.PTRACE_CONT, tid)
            self._loop()
        finally:
            with self.lock:
                self.done = True
            threads = {tid for per_tid in self.result.hits.values() for tid in per_tid}
            if self.displaced == "inline" and len(threads) > 1:
                self.result.warnings.append(
                    f"--inline-step with {len(threads)} threads: while one thread stepped the "
                    "original instruction, others could run through the probe unseen; the "
                    "counts can be low (use the default out-of-line mode)"
                )
            if self.mem_fd >= 0:
                os.close(self.mem_fd)
        return self.result

    def _watch_stop(self) -> None:
        """Wake the loop (blocked in waitpid) when asked to stop: a SIGSTOP to one thread."""
        while not self.stop.wait(0.1):
            if self.done:
                return
        with self.lock:
            if self.done:
                return
            for task in list(self.tasks.values()):
                self.wakers.append(task.tid)  # before the signal: the loop may see it at once
                if pt.tgkill(task.pid, task.tid, signal.SIGSTOP) == 0:
                    return
                self.wakers.pop()

    def _loop(self) -> None:
        while True:
            try:
                tid, status = os.waitpid(-1, pt.WALL)
            except ChildProcessError:
                return
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                self.tasks.pop(tid, None)
                if tid == self.pid:
                    if os.WIFSIGNALED(status):
                        self.result.signal = os.WTERMSIG(status)
                    else:
                        self.result.exit_code = os.WEXITSTATUS(status)
                    if self.child is not None:  # reaped here, not by Popen
                        self.child.returncode = os.waitstatus_to_exitcode(status)
                    return
            else:
                if not self.stopping and self.stop.is_set():
                    self._begin_stopping()
                task = self.tasks.get(tid)
                if task is None:  # a new thread or child whose creation event is still to come
                    task = self.tasks[tid] = _Task(tid, self.pid, kind="")
                self._stopped(task, status)
            if self.stopping and self.tasks and self._all_parked():
                self._detach_all()
                return

    def _stopped(self, task: _Task, status: int) -> None:
        sig = os.WSTOPSIG(status)
        event = status >> 16
        if event:
            self._event(task, event)
            return
        if not task.started:
            task.started = True
            if sig in (signal.SIGSTOP, signal.SIGTRAP):
                self._first_stop(task)
                return
        if sig == signal.SIGTRAP:
            if task.stepping is not None:
                self._stepped(task)
                return
            regs = pt.getregs(task.tid)
            at = regs.rip - 1
            site = self.sites.get(at)
            if site is not None:
                self._hit(task, site, regs)
                return
            if self.trampoline and at == self.trampoline:
                self._returned(task, regs)
                return
        if sig == signal.SIGSTOP and self.stopping and task.stop_sent:
            task.parked = True
            return
        self._resume(task, sig)

    def _first_stop(self, task: _Task) -> None:
        """A new thread or child stopped for the first time: once we know which it is
        (its creation event may come later), let it run."""
        if task.kind == "":
            return  # wait for the event
        if task.kind == "fork":
            self._let_fork_go(task)
        elif self.stopping:
            task.parked = True
        else:
            self._resume(task)

    def _resume(self, task: _Task, sig: int = 0) -> None:
        with contextlib.suppress(ProcessLookupError):
            pt.call(pt.PTRACE_SINGLESTEP if task.stepping else pt.PTRACE_CONT, task.tid, 0, sig)

    def _event(self, task: _Task, event: int) -> None:
        if event in (pt.EVENT_CLONE, pt.EVENT_FORK, pt.EVENT_VFORK):
            msg = ctypes.c_ulong()
            pt.call(pt.PTRACE_GETEVENTMSG, task.tid, 0, ctypes.addressof(msg))
            new = int(msg.value)
            child = self.tasks.setdefault(new, _Task(new, self.pid, kind=""))
            child.kind = _CHILD_KIND[event]
            if event == pt.EVENT_FORK:
                child.pid = new
                child.pending = list(task.pending)  # its stack has our return addresses too
            if self.stopping:
                child.stop_sent = True
                pt.tgkill(child.pid, new, signal.SIGSTOP)
            if child.started:
                self._first_stop(child)
        elif event == pt.EVENT_EXEC:
            if task.kind == "vfork":
                self.tasks.pop(task.tid, None)
                with contextlib.suppress(OSError):
                    pt.call(pt.PTRACE_DETACH, task.tid)
                return
            self.result.warnings.append(
                "the program called exec: its new image is not probed; probes removed"
            )
            self._let_go_after_exec()
            return
        elif event == pt.EVENT_STOP and self.stopping and task.stop_sent:
            task.parked = True
            return
        self._resume(task)

    def _let_fork_go(self, task: _Task) -> None:
        """A forked child has our breakpoints and return addresses in its copy of memory:
        put the originals back and let it run untraced."""
        with contextlib.suppress(OSError):
            fd = os.open(f"/proc/{task.tid}/mem", os.O_RDWR)
            try:
                for site in self.sites.values():
                    os.pwrite(fd, site.original[:1], site.address)
                for slot, ret, _ in task.pending:
                    os.pwrite(fd, ret.to_bytes(8, "little"), slot)
            finally:
                os.close(fd)
        self.tasks.pop(task.tid, None)
        with contextlib.suppress(OSError):
            pt.call(pt.PTRACE_DETACH, task.tid)

    def _let_go_after_exec(self) -> None:
        for tid in list(self.tasks):
            with contextlib.suppress(OSError):
                pt.call(pt.PTRACE_DETACH, tid)
        self.tasks.clear()
        self.sites.clear()
        self.result.detached = self.child is None

    # -- hits ----------------------------------------------------------------------------------

    def _hit(self, task: _Task, site: _Site, regs: pt.Regs) -> None:
        now = time.monotonic_ns()
        for i in site.entry:
            point = self.points[i]
            values = tuple(fetch_value(f, regs, self.read) for f in point.spec.fetches)
            hit = Hit(now, task.tid, i, values)
            self.result.count(hit)
            self.on_hit(hit)
        if site.returns:
            raw = self.read(regs.rsp, 8)
            if raw is not None:
                task.pending.append((regs.rsp, int.from_bytes(raw, "little"), site))
                self.write(regs.rsp, self.trampoline.to_bytes(8, "little"))
        self._displaced(task, site, regs)

    def _displaced(self, task: _Task, site: _Site, regs: pt.Regs) -> None:
        """Run the instruction the breakpoint displaced, then let the thread go."""
        if site.how == "emulate":
            assert site.emulate is not None
            site.emulate(regs, self.read, self.write)
        elif site.how == "boost":
            regs.rip = site.slot
        elif site.how == "step":
            regs.rip = site.slot
            task.stepping = site
        else:  # inline
            self.write(site.address, site.original[:1])
            regs.rip = site.address
            task.stepping = site
        pt.setregs(task.tid, regs)
        self._resume(task)

    def _stepped(self, task: _Task) -> None:
        site = task.stepping
        assert site is not None
        task.stepping = None
        regs = pt.getregs(task.tid)
        if site.how == "inline":
            if pt.trap_code(task.tid) == pt.SI_KERNEL:
                # another thread put the breakpoint back before this one stepped: step again
                self.write(site.address, site.original[:1])
                regs.rip = site.address
                pt.setregs(task.tid, regs)
                task.stepping = site
                self._resume(task)
                return
            if site.address in self.sites:
                self.write(site.address, b"\xcc")
        elif regs.rip == site.slot + site.size:
            regs.rip = site.address + site.size
            pt.setregs(task.tid, regs)
        self._resume(task)

    def _returned(self, task: _Task, regs: pt.Regs) -> None:
        slot = regs.rsp - 8  # where the return address the trampoline replaced was
        while task.pending and task.pending[-1][0] < slot:
            task.pending.pop()  # frames a longjmp skipped
        if not task.pending or task.pending[-1][0] != slot:
            self.result.warnings.append(
                f"thread {task.tid} returned to the trampoline from an unknown frame"
            )
            self._resume(task, signal.SIGTRAP)
            return
        _, ret, site = task.pending.pop()
        now = time.monotonic_ns()
        rax = regs.rax - 2**64 if regs.rax >> 63 else regs.rax
        for i in site.returns:
            point = self.points[i]
            values = tuple(fetch_value(f, regs, self.read) for f in point.spec.fetches)
            hit = Hit(now, task.tid, i, values, rax)
            self.result.count(hit)
            self.on_hit(hit)
        regs.rip = ret
        pt.setregs(task.tid, regs)
        self._resume(task)

    # -- letting go ----------------------------------------------------------------------------

    def _begin_stopping(self) -> None:
        self.stopping = True
        for task in self.tasks.values():
            if task.tid in self.wakers:
                task.stop_sent = True
            if not task.stop_sent:
                task.stop_sent = True
                pt.tgkill(task.pid, task.tid, signal.SIGSTOP)

    def _all_parked(self) -> bool:
        return all(t.parked for t in self.tasks.values())

    def _detach_all(self) -> None:
        pages = [p for p, _ in self.pages.values()]
        in_page = lambda a: any(p <= a < p + _XOL_PAGE for p in pages)  # noqa: E731
        for task in self.tasks.values():
            regs = pt.getregs(task.tid)
            for _ in range(4):  # a slot holds one instruction and a jump back
                if not in_page(regs.rip) or regs.rip == self.trampoline:
                    break
                pt.call(pt.PTRACE_SINGLESTEP, task.tid)
                os.waitpid(task.tid, pt.WALL)
                regs = pt.getregs(task.tid)
            if task.stepping is not None and task.stepping.how == "inline":
                task.stepping = None  # the original byte is back already
            if self.trampoline and regs.rip == self.trampoline and task.pending:
                _, ret, _ = task.pending.pop()  # returned to the trampoline, not yet trapped
                regs.rip = ret
                pt.setregs(task.tid, regs)
            for slot, ret, _ in task.pending:
                if self.read(slot, 8) == self.trampoline.to_bytes(8, "little"):
                    self.write(slot, ret.to_bytes(8, "little"))
            task.pending.clear()
        for site in self.sites.values():
            self.write(site.address, site.original[:1])
        leader = next(iter(self.tasks), None)
        if leader is not None and all(not in_page(pt.getregs(t).rip) for t in self.tasks):
            for page in pages:
                with contextlib.suppress(OSError):
                    self._syscall(leader, _SYS_MUNMAP, page, _XOL_PAGE)
        for tid in self.tasks:
            with contextlib.suppress(OSError):
                pt.call(pt.PTRACE_DETACH, tid)
        # A SIGSTOP of ours still pending in a thread would stop the whole process once it
        # is no longer traced (seen once in a loaded test run: the program left in state T);
        # SIGCONT discards pending stop signals, and a running process ignores it.
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
        self.result.detached = True
