"""The step engine: ptrace single-stepping, one instruction at a time (ctypes).

Slow (about 5-6 thousand instructions a second here) but exact, and independent of Frida:
it is the oracle the stalker engine is tested against.  It writes the same store format:
one BLOCK record per run of instructions ending in a control-flow instruction (taken or
not), like Stalker's blocks.  A signal delivery is an explicit BRANCH record of kind
INTERRUPT (from: where the interrupted code resumes, to: the handler), so handlers are
traced and the decoder knows where they return to.

It spawns the program stopped at exec, runs it natively to the executable's `_init` (where
the stalker engine starts too: base.init_offset), or to `main` when it has none (an int3
there), then steps every thread until the program ends.  Threads are followed through clone.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from ..errors import EngineUnavailableError, InvalidArgumentError, LaunchError
from ..store import Flags, Mode, Ring, RingReader, RingWriter
from ..store.format import (
    BLOCK_ADDR_MASK,
    BLOCK_OFF_MASK,
    BranchKind,
    FaultAccess,
    RecordType,
    block_word,
)
from ..store.tracedir import ModuleEvent, TraceDir, drain_to_file
from ..x86 import NOT_A_BRANCH, classify, memory_access
from . import ptrace as pt
from .base import (
    Events,
    RecordOptions,
    RecordResult,
    Target,
    ThreadStats,
    finish_meta,
    init_offset,
    start_meta,
)
from .stalker import resolve_program

_FLUSH = 4096  #: BLOCK words buffered per thread before they go into its ring
_FAULTS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}
_SI_TKILL = -6  #: si_code of a signal sent with tgkill (raise, abort)


class _Thread:
    """One traced thread's ring and the block being stepped through."""

    def __init__(self, tid: int, tracedir: TraceDir, options: RecordOptions) -> None:
        self.tid = tid
        self.ring = Ring.create(
            tracedir.ring_path(tid),
            options.buffer_size,
            Mode.WRAP if options.mode == Mode.WRAP else Mode.STREAM,
            Flags.TRACE if options.mode == Mode.WRAP else Flags.TRACE | Flags.SIGNAL,
            tid=tid,
        )
        self.reader: RingReader | None = None
        self.fd: int | None = None
        if options.mode != Mode.WRAP:
            self.reader = RingReader(self.ring, consume=True)
            self.fd = os.open(tracedir.stream_path(tid), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.writer = RingWriter(self.ring)
        self.pending: list[int] = []
        self.at: int | None = None  #: where the thread is stopped (not yet executed)
        self.block_start = 0  #: first instruction of the current block
        self.last: int | None = None  #: last executed instruction of the current block
        self.signal_at: int | None = None  #: where a signal being delivered interrupted it
        self.signal_caught = False  #: whether that signal has a handler to run
        self.records = 0

    def start(self, rip: int) -> None:
        self.at = self.block_start = rip
        self.last = None

    def end_block(self, last: int) -> None:
        off = last - self.block_start
        if 0 < self.block_start <= BLOCK_ADDR_MASK and 0 <= off <= BLOCK_OFF_MASK:
            self.pending.append(block_word(self.block_start, off))
        else:
            self.flush()
            self.writer.write(RecordType.BLOCK, off, self.block_start)
        self.records += 1
        self.last = None
        if len(self.pending) >= _FLUSH:
            self.flush()

    def interrupt(self, resume: int, handler: int) -> None:
        self.flush()
        self.writer.write(RecordType.BRANCH, BranchKind.INTERRUPT, resume, handler)
        self.records += 1

    def flush(self) -> None:
        if self.pending:
            self.writer.write_blocks(np.array(self.pending, dtype=np.uint64))
            self.pending.clear()
        if self.reader is not None and self.fd is not None:
            drain_to_file(self.reader, self.fd)

    def close(self) -> ThreadStats:
        if self.last is not None:
            self.end_block(self.last)
        self.flush()
        self.writer.close()
        if self.reader is not None and self.fd is not None:
            drain_to_file(self.reader, self.fd, final=True)
            self.reader.close()
            os.close(self.fd)
        stats = ThreadStats(records=self.records, lost=self.ring.lost_records)
        self.ring.close()
        return stats


class StepEngine:
    name = "step"

    def record(
        self, target: Target, options: RecordOptions, events: Events, stop: threading.Event
    ) -> RecordResult:
        if target.pid is not None:
            raise InvalidArgumentError(
                "the step engine only traces programs it starts",
                hint="branchtrace record --engine step -- PROG, or use the stalker engine",
            )
        if options.follow_fork or options.sched:
            raise InvalidArgumentError(
                "the step engine has no --follow-fork or --sched", hint="use the stalker engine"
            )
        size = 1 << (options.buffer_size.bit_length() - 1)
        if size < 16 * _FLUSH:
            raise InvalidArgumentError(f"buffer size {options.buffer_size} is too small")
        options = dataclasses.replace(options, buffer_size=size)
        program = resolve_program(target.argv[0])
        init = init_offset(program)  # where tracing starts, as the stalker engine's does
        # an offset from the load base is where it is relative to the lowest mapping, PIE or not
        start, pie = (init, True) if init is not None else _main_address(program)
        tracedir = TraceDir.create(options.output)
        meta = start_meta(self.name, options, target.argv, str(program))
        try:
            child = pt.spawn_stopped(program, target.argv)
        except LaunchError:
            tracedir.remove()
            raise
        pid = child.pid
        meta["pid"] = pid
        tracedir.write_meta(meta)
        pt.call(pt.PTRACE_SETOPTIONS, pid, 0, pt.O_TRACECLONE | pt.O_TRACEEXIT | pt.O_EXITKILL)
        session = _Session(pid, program, tracedir, options, stop)
        events.started(
            f"recording {target.argv[0]} (pid {pid}) from {'main' if init is None else '_init'} "
            "with the step engine "
            f"(ptrace single-step: exact, slow), {options.mode.name.lower()} mode, "
            f"into {options.output}; Ctrl-C to stop"
        )
        result = RecordResult(options.output, pid)
        try:
            session.run_to(session.runtime_address(start, pie))
            status = session.step_all()
        finally:
            result.threads = session.close()
        if os.WIFSIGNALED(status):
            result.signal = os.WTERMSIG(status)
        elif os.WIFEXITED(status):
            result.exit_code = os.WEXITSTATUS(status)
        with contextlib.suppress(ChildProcessError):
            child.wait(timeout=0)
        finish_meta(meta, result, [])
        tracedir.write_meta(meta)
        return result


def _caught(tid: int, sig: int) -> bool:
    """Whether thread `tid` has a handler for signal `sig` (SigCgt in its status): a signal
    without one, delivered as the thread single-steps, runs no code, and the step runs the
    instruction the thread was at."""
    try:
        status = Path(f"/proc/{tid}/status").read_text()
    except OSError:
        return True  # as before: a delivery that moves the pc is taken for a handler's
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return True


def _main_address(program: Path) -> tuple[int, bool]:
    """main's file address, and whether the executable is position-independent."""
    with open(program, "rb") as f:
        elf = ELFFile(f)
        pie = elf["e_type"] == "ET_DYN"
        for name in (".symtab", ".dynsym"):
            table = elf.get_section_by_name(name)
            if isinstance(table, SymbolTableSection):
                for sym in table.get_symbol_by_name("main") or []:
                    if sym["st_value"]:
                        return int(sym["st_value"]), pie
    raise EngineUnavailableError(
        f"{program} has no symbol for main, which the step engine starts at",
        hint="use the stalker engine for stripped programs",
    )


class _Session:
    def __init__(
        self,
        pid: int,
        program: Path,
        tracedir: TraceDir,
        options: RecordOptions,
        stop: threading.Event,
    ) -> None:
        self.pid = pid
        self.program = program
        self.tracedir = tracedir
        self.options = options
        self.stop = stop
        self.threads: dict[int, _Thread] = {}
        self.stats: dict[int, ThreadStats] = {}
        self.mem = open(f"/proc/{pid}/mem", "rb", buffering=0)  # noqa: SIM115
        self.kinds: dict[int, tuple[int, int]] = {}
        self.mapped: list[tuple[int, int]] = []
        self._read_modules()

    # -- memory and modules --------------------------------------------------------------------

    def _read_modules(self) -> None:
        """Record the file-backed executable mappings not recorded yet (module loads)."""
        seen = {(b, e) for b, e in self.mapped}
        per_file: dict[str, list[int]] = {}
        for line in Path(f"/proc/{self.pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            per_file.setdefault(parts[5], []).extend((lo, hi))
        for path, bounds in per_file.items():
            base, end = min(bounds), max(bounds)
            if (base, end) in seen:
                continue
            self.mapped.append((base, end))
            self.tracedir.append_module(
                ModuleEvent("load", base, end - base, path, time.time_ns(), self.pid)
            )

    def runtime_address(self, file_address: int, pie: bool) -> int:
        """Where the executable's `file_address` is in the process (its lowest mapping is
        its load base when it is position-independent)."""
        exe = str(self.program)
        for line in Path(f"/proc/{self.pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5] == exe and int(parts[2], 16) == 0:
                return int(parts[0].split("-")[0], 16) + file_address if pie else file_address
        raise EngineUnavailableError(f"cannot find {exe} in the memory of process {self.pid}")

    def kind(self, address: int) -> tuple[int, int]:
        known = self.kinds.get(address)
        if known is None:
            try:
                code = os.pread(self.mem.fileno(), 16, address)
            except OSError:
                code = b""
            known = classify(code, address)
            self.kinds[address] = known
            if not any(lo <= address < hi for lo, hi in self.mapped):
                self._read_modules()  # code from a library loaded since (dlopen)
        return known

    # -- running -----------------------------------------------------------------------------

    def run_to(self, address: int) -> None:
        """Run the stopped process natively up to `address` (an int3 there)."""
        word = pt.call(pt.PTRACE_PEEKTEXT, self.pid, address) & (2**64 - 1)
        pt.call(pt.PTRACE_POKETEXT, self.pid, address, (word & ~0xFF) | 0xCC)
        pt.call(pt.PTRACE_CONT, self.pid)
        _, status = os.waitpid(self.pid, pt.WALL)
        if not os.WIFSTOPPED(status) or os.WSTOPSIG(status) != signal.SIGTRAP:
            raise LaunchError("the program ended before tracing could start")
        pt.call(pt.PTRACE_POKETEXT, self.pid, address, word)
        regs = pt.getregs(self.pid)
        regs.rip = address
        pt.setregs(self.pid, regs)
        self._read_modules()
        self._thread(self.pid).start(address)

    def _thread(self, tid: int) -> _Thread:
        if tid not in self.threads:
            self.threads[tid] = _Thread(tid, self.tracedir, self.options)
        return self.threads[tid]

    def step_all(self) -> int:
        """Single-step every thread until the process ends; its wait status."""
        pt.call(pt.PTRACE_SINGLESTEP, self.pid)
        delivering: set[int] = set()
        while True:
            if self.stop.is_set():
                for tid in list(self.threads):
                    with contextlib.suppress(OSError):
                        os.kill(tid, signal.SIGKILL)
                self.stop.clear()
            tid, status = os.waitpid(-1, pt.WALL)
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                t = self.threads.pop(tid, None)
                if t is not None:
                    self.stats[tid] = t.close()
                if tid == self.pid:
                    return status
                continue
            sig = os.WSTOPSIG(status)
            t = self._thread(tid)
            rip = pt.call(pt.PTRACE_PEEKUSER, tid, pt.RIP_OFFSET) & (2**64 - 1)
            inject = 0
            if status >> 16:  # a ptrace event (clone) stop: nothing ran
                if status >> 16 == pt.EVENT_CLONE:
                    msg = ctypes.c_ulong()
                    pt.call(pt.PTRACE_GETEVENTMSG, tid, 0, ctypes.addressof(msg))
                    self._thread(int(msg.value))
                elif status >> 16 == pt.EVENT_EXIT:
                    self._exiting(t, rip)
            elif t.at is None:  # a new thread's first stop
                t.start(rip)
            elif sig != signal.SIGTRAP:
                # signal-delivery-stop: the next step delivers it
                inject = sig
                undelivered = tid in delivering and t.signal_at == rip
                t.signal_at = rip
                t.signal_caught = _caught(tid, sig)
                delivering.add(tid)
                self._fault(t, sig, rip, undelivered)
            elif tid in delivering and not t.signal_caught:
                # ignored (SIGCHLD's default): no handler, so the step ran the instruction
                # the thread was at, as any step does
                delivering.discard(tid)
                t.signal_at = None
                self._stepped(t, rip)
            elif tid in delivering:
                delivering.discard(tid)
                self._delivered(t, rip)
            else:
                self._stepped(t, rip)
            pt.call(pt.PTRACE_SINGLESTEP, tid, 0, inject)

    def _stepped(self, t: _Thread, rip: int) -> None:
        """The thread executed the instruction at `t.at` and stopped at `rip`."""
        executed = t.at
        if executed is None or rip == executed:
            return  # a rep-prefixed instruction mid-way, or nothing ran
        kind, size = self.kind(executed)
        if kind != NOT_A_BRANCH or rip != executed + size:
            t.end_block(executed)
            t.block_start = rip
        else:
            t.last = executed
        t.at = rip

    def _exiting(self, t: _Thread, rip: int) -> None:
        """The thread is about to be gone (PTRACE_EVENT_EXIT).  When it is inside a system
        call (rip right after the `syscall` it was stopped at), it ran that instruction,
        which no single step reported: its block ends there.  When that call is exit or
        exit_group, the thread ended itself, and a THREAD_EXIT record says so; a thread
        ended where it was (another thread's exit_group, a signal) has none."""
        if t.at is None or rip != t.at + 2 or self.kind(t.at)[0] != BranchKind.SYSCALL:
            return
        t.end_block(t.at)
        t.at = None
        regs = pt.getregs(t.tid)
        call = regs.get("orig_rax")
        if call in (60, 231):
            t.flush()
            status = regs.get("rdi") & 0xFFFFFFFF
            now = time.monotonic_ns()
            t.writer.write(RecordType.THREAD_EXIT, t.tid, now, rip - 2, status, call)
            t.records += 1

    def _fault(self, t: _Thread, sig: int, rip: int, undelivered: bool) -> None:
        """A signal is about to be delivered to the thread at `rip`.  When an instruction
        raised it (a fault at `rip`, which did not complete; or SIGABRT from the thread's
        own system call, which did), the thread's block ends there and a FAULT record says
        so, as the stalker engine writes it.  `undelivered`: the signal before it, at the
        same place, was not delivered."""
        if t.at is None:
            return
        code, sender, address = pt.siginfo(t.tid)
        if undelivered and sig == signal.SIGSEGV and code == pt.SI_KERNEL:
            return  # no room for that signal's frame (a stack overflow): the kernel's SIGSEGV
        if sig == signal.SIGABRT:
            if code != _SI_TKILL or sender != self.pid:
                return
            if rip == t.at + 2 and self.kind(t.at)[0] == BranchKind.SYSCALL:
                self._stepped(t, rip)  # it ran the call, which no single step reported
            elif rip != t.at or t.last is not None or self.kind(rip - 2)[0] != BranchKind.SYSCALL:
                return  # (the step after the call was reported, and ended its block)
        elif sig in _FAULTS and code > 0 and t.at == rip:
            t.end_block(rip)  # tried, and the trace says so
        else:
            return
        access = FaultAccess.UNKNOWN
        if sig in (signal.SIGSEGV, signal.SIGBUS):
            try:
                code_bytes = os.pread(self.mem.fileno(), 16, rip)
            except OSError:
                code_bytes = b""
            access = FaultAccess.EXECUTE if address == rip else memory_access(code_bytes, rip)
        else:
            address = 0
        t.flush()
        now = time.monotonic_ns()
        t.writer.write(RecordType.FAULT, sig, now, rip, address, access, code & 0xFFFFFFFF)
        t.records += 1

    def _delivered(self, t: _Thread, rip: int) -> None:
        """A signal was delivered; the thread stopped at `rip`: its handler, or where it was
        if the signal was ignored."""
        resume, t.signal_at = t.signal_at, None
        if resume is None or rip == resume:
            return
        if t.last is not None:
            t.end_block(t.last)
        t.interrupt(resume, rip)
        t.start(rip)

    def close(self) -> dict[int, ThreadStats]:
        for tid, t in list(self.threads.items()):
            self.stats[tid] = t.close()
        self.threads.clear()
        self.mem.close()
        for stats in self.stats.values():
            stats.pid = self.pid
        return self.stats
