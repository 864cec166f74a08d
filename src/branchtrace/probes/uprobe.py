"""The uprobe probe engine: the kernel's uprobes through `perf_event_open`.

Each probe is a perf event of the `uprobe` PMU (`config1` = the ELF file's path,
`config2` = the probe's file offset, bit 0 of `config` = a return probe), opened once
per CPU for every process (pid -1); samples of other processes running the same code are
dropped by pid.  Why not per thread with `inherit` (measured here, kernel 6.18): an
inherited uprobe event re-reads its path pointer in the probed process, so the program's
clone() fails with EFAULT; and with per-thread events, hits of the last running threads
silently vanish once other threads exit (the kernel unapplies the breakpoint from the
address space).  System-wide events have neither problem.

Every hit is a sample with the thread id, a CLOCK_MONOTONIC time and the registers the
values need; when a value lives on the stack the sample carries a copy of the stack from
%rsp, so it is the value at the hit.  Other memory (strings, pointers away from the stack)
is read from the process when the sample is drained, a few milliseconds later at most.
Samples the kernel could not store (a full ring) arrive as PERF_RECORD_LOST and are
counted.

The kernel does the breakpoint, the out-of-line step and the clean-up (closing the events
removes the probes): the probed process pays one trap per hit (about 11 us here) and never
waits for us.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import select
import struct
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from ..engines import ptrace as pt
from ..engines.base import Target
from ..engines.stalker import resolve_program
from ..errors import (
    AlreadyTracedError,
    EngineUnavailableError,
    NoSuchProcessError,
    PermissionDeniedError,
)
from .base import Hit, ProbeResult, fetch_value
from .spec import ProbePoint, ProbeSpecError

PMU_TYPE = Path("/sys/bus/event_source/devices/uprobe/type")
_SYS_PERF_EVENT_OPEN = 298
_ATTR_SIZE = 128
_SAMPLE_TID, _SAMPLE_TIME, _SAMPLE_REGS_USER, _SAMPLE_STACK_USER = 1 << 1, 1 << 2, 1 << 12, 1 << 13
_FLAG_EXCLUDE_HV = 1 << 6
_FLAG_WATERMARK, _FLAG_USE_CLOCKID = 1 << 14, 1 << 25
_CLOCK_MONOTONIC = 1
_PERF_FLAG_FD_CLOEXEC = 1 << 3
_PERF_RECORD_LOST, _PERF_RECORD_THROTTLE, _PERF_RECORD_SAMPLE = 2, 5, 9
#: the kernel stops an event that samples more often than this allows per tick
#: ("throttling", samples silently missed); we raise it for the run, as root
SAMPLE_RATE = Path("/proc/sys/kernel/perf_event_max_sample_rate")
_RATE_NEEDED = 1_000_000
_DATA_PAGES = 2048  #: up to 8 MiB ring per probe and CPU: ~150k hits of a few values
_BUDGET_PAGES = 65536  #: 256 MiB of rings at most, over all probes and CPUs
#: the x86 perf register numbers (asm/perf_regs.h) of the registers a value can name
PERF_REGS = {
    "rax": 0, "rbx": 1, "rcx": 2, "rdx": 3, "rsi": 4, "rdi": 5, "rbp": 6, "rsp": 7,
    "rip": 8, **{f"r{i}": 8 + i for i in range(8, 16)},
}  # fmt: skip
_MAX_STACK = 65528

_libc = ctypes.CDLL(None, use_errno=True)


def available() -> str | None:
    """Why the uprobe engine cannot run here, or None if it can."""
    if not PMU_TYPE.exists():
        return "the kernel has no uprobe PMU (/sys/bus/event_source/devices/uprobe)"
    return None


class _Ring:
    """One perf event and its ring."""

    def __init__(self, fd: int, probe: int, pages: int) -> None:
        self.fd = fd
        self.probe = probe
        self.page = mmap.PAGESIZE
        self.size = pages * self.page
        self.mm = mmap.mmap(fd, (1 + pages) * self.page)

    def records(self) -> list[tuple[int, bytes]]:
        """(type, body) of every new record, consumed."""
        mm = self.mm
        head, tail = struct.unpack_from("QQ", mm, 1024)
        if head == tail:
            return []
        size = self.size
        start, end = tail % size, head % size
        if head - tail >= size or end < start or (end == start and head != tail):
            data = bytes(mm[self.page + start : self.page + size]) + bytes(
                mm[self.page : self.page + end]
            )
        else:
            data = bytes(mm[self.page + start : self.page + end])
        out = []
        pos = 0
        while pos + 8 <= len(data):
            rtype, _misc, rsize = struct.unpack_from("IHH", data, pos)
            if rsize == 0:
                break
            out.append((rtype, data[pos + 8 : pos + rsize]))
            pos += rsize
        struct.pack_into("Q", mm, 1032, head)
        return out

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


class UprobeEngine:
    name = "uprobe"

    def run(
        self,
        target: Target,
        points: list[ProbePoint],
        on_hit: Callable[[Hit], None],
        started: Callable[[str], None],
        stop: threading.Event,
    ) -> ProbeResult:
        why = available()
        if why:
            raise EngineUnavailableError(why, hint="use --engine xol")
        pmu = int(PMU_TYPE.read_text())
        child: subprocess.Popen[bytes] | None = None
        if target.pid is not None:
            pid = target.pid
            if not Path(f"/proc/{pid}").is_dir():
                raise NoSuchProcessError(f"no process with pid {pid}")
        else:
            child = pt.spawn_stopped(resolve_program(target.argv[0]), target.argv)
            pid = child.pid  # stopped at exec: nothing ran yet
        result = ProbeResult(pid)
        rings: list[_Ring] = []
        cpus = os.cpu_count() or 1
        pages = max(128, min(_DATA_PAGES, _BUDGET_PAGES // (cpus * len(points))))
        pages = 1 << (pages.bit_length() - 1)
        try:
            for i, point in enumerate(points):
                path = ctypes.create_string_buffer(str(point.path).encode())
                for cpu in range(cpus):
                    rings.append(_Ring(_open(pmu, point, ctypes.addressof(path), cpu), i, pages))
        except BaseException:
            for r in rings:
                r.close()
            if child is not None:
                child.kill()
                child.wait()
            raise
        if child is not None:
            pt.call(pt.PTRACE_DETACH, pid)  # it runs, probed by the kernel
        what = f"process {pid}" if target.pid is not None else f"{target.argv[0]} (pid {pid})"
        raised = _raise_sample_rate()
        note = f", {SAMPLE_RATE.name} raised to {_RATE_NEEDED} for the run" if raised else ""
        started(
            f"probing {what} at {len(points)} point(s) with the uprobe engine (kernel uprobes "
            f"via perf_event_open, on the files: other processes running the same code trap "
            f"too, their hits are dropped{note}); Ctrl-C to stop"
        )
        mem_fd = -1
        with contextlib.suppress(OSError):
            mem_fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)

        def read(address: int, n: int) -> bytes | None:
            try:
                data = os.pread(mem_fd, n, address)
            except (OSError, OverflowError):
                return None
            return data or None

        decoder = _Decoder(points, read, result, on_hit, pid)
        poller = select.poll()
        for r in rings:
            poller.register(r.fd, select.POLLIN)
        try:
            while True:
                stopping = stop.is_set()
                ended = _ended(child, pid, result)
                poller.poll(50)
                decoder.drain(rings)
                if ended or stopping:
                    result.detached = not ended
                    break
        finally:
            for r in rings:
                r.close()  # the kernel takes the probes out
            if mem_fd >= 0:
                os.close(mem_fd)
            _restore_sample_rate(raised)
        if decoder.throttled:
            result.warnings.append(
                f"the kernel throttled the probes {decoder.throttled} time(s): hits were missed "
                f"(raise {SAMPLE_RATE.name})"
            )
        return result


def _raise_sample_rate() -> int | None:
    """Lift the kernel's sample-rate cap so a busy probe is not throttled; the old value."""
    try:
        old = int(SAMPLE_RATE.read_text())
        if old >= _RATE_NEEDED:
            return None
        SAMPLE_RATE.write_text(str(_RATE_NEEDED))
    except (OSError, ValueError):
        return None  # not root: throttling is then detected and reported
    return old


def _restore_sample_rate(old: int | None) -> None:
    if old is not None:
        with contextlib.suppress(OSError):
            SAMPLE_RATE.write_text(str(old))


def _ended(child: subprocess.Popen[bytes] | None, pid: int, result: ProbeResult) -> bool:
    if child is not None:
        code = child.poll()
        if code is None:
            return False
        if code < 0:
            result.signal = -code
        else:
            result.exit_code = code
        return True
    return not Path(f"/proc/{pid}").is_dir()


def _stack_needed(points: list[ProbePoint]) -> int:
    """Bytes of stack from %rsp the samples must carry for the values read off the stack."""
    need = 0
    for p in points:
        for f in p.spec.fetches:
            if f.source == "mem" and f.reg == "rsp" and f.offset >= 0:
                need = max(need, f.offset + 8)
    return min((need + 7) & ~7, _MAX_STACK)


def registers_needed(point: ProbePoint) -> list[str]:
    """The registers a hit's sample must carry, in the kernel's order."""
    names = {f.reg for f in point.spec.fetches}
    if point.is_return:
        names.add("rax")
    if any(f.source == "mem" and f.reg == "rsp" for f in point.spec.fetches):
        names.add("rsp")
    return sorted(names, key=PERF_REGS.__getitem__)


def _open(pmu: int, point: ProbePoint, path: int, cpu: int) -> int:
    attr = bytearray(_ATTR_SIZE)
    regs = registers_needed(point)
    mask = sum(1 << PERF_REGS[r] for r in regs)
    stack = _stack_needed([point])
    sample = _SAMPLE_TID | _SAMPLE_TIME
    sample |= (_SAMPLE_REGS_USER if mask else 0) | (_SAMPLE_STACK_USER if stack else 0)
    flags = _FLAG_EXCLUDE_HV | _FLAG_WATERMARK | _FLAG_USE_CLOCKID
    struct.pack_into("IIQQQQQ", attr, 0, pmu, _ATTR_SIZE, int(point.is_return), 1, sample, 0, flags)
    struct.pack_into("I", attr, 48, 128 * mmap.PAGESIZE // 4)  # wake early
    struct.pack_into("QQ", attr, 56, path, point.file_offset)
    struct.pack_into("QIi", attr, 80, mask, stack, _CLOCK_MONOTONIC)
    buf = (ctypes.c_char * _ATTR_SIZE).from_buffer(attr)
    fd = _libc.syscall(_SYS_PERF_EVENT_OPEN, buf, -1, cpu, -1, _PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        if err in (1, 13):
            raise PermissionDeniedError(
                "perf_event_open refused a uprobe (no permission)",
                hint="run as root, or use --engine xol",
            )
        if err == 16:
            raise AlreadyTracedError(f"{point.label}: the kernel refused the probe (busy)")
        if err in (22, 95, 524):
            raise ProbeSpecError(
                f"{point.label}: the kernel cannot place a uprobe at {point.path.name}"
                f"+{point.file_offset:#x} ({os.strerror(err)})",
                hint="try --engine xol",
            )
        raise EngineUnavailableError(f"perf_event_open for {point.label}: {os.strerror(err)}")
    return int(fd)


class _Decoder:
    def __init__(
        self,
        points: list[ProbePoint],
        read: Callable[[int, int], bytes | None],
        result: ProbeResult,
        on_hit: Callable[[Hit], None],
        pid: int,
    ) -> None:
        self.pid = pid
        self.others = 0  #: hits of other processes running the same code (discarded)
        self.points = points
        self.read = read
        self.result = result
        self.on_hit = on_hit
        self.registers = [registers_needed(p) for p in points]
        self.throttled = 0

    def drain(self, rings: list[_Ring]) -> None:
        hits: list[Hit] = []
        for ring in rings:
            for rtype, body in ring.records():
                if rtype == _PERF_RECORD_SAMPLE:
                    if struct.unpack_from("I", body, 0)[0] != self.pid:
                        self.others += 1
                        continue
                    hits.append(self._sample(ring.probe, body))
                elif rtype == _PERF_RECORD_LOST:
                    self.result.lost += struct.unpack_from("Q", body, 8)[0]
                elif rtype == _PERF_RECORD_THROTTLE:
                    self.throttled += 1
        hits.sort(key=lambda h: h.time_ns)  # the CPUs' rings merged in time order
        for hit in hits:
            self.result.count(hit)
            self.on_hit(hit)

    def _sample(self, probe: int, body: bytes) -> Hit:
        _pid, tid, time_ns = struct.unpack_from("IIQ", body, 0)
        pos = 16
        regs: dict[str, int] = {}
        names = self.registers[probe]
        if names:
            (abi,) = struct.unpack_from("Q", body, pos)
            pos += 8
            if abi:
                regs = dict(
                    zip(names, struct.unpack_from(f"{len(names)}Q", body, pos), strict=True)
                )
                pos += 8 * len(names)
        point = self.points[probe]
        read = self.read
        if pos < len(body):
            (size,) = struct.unpack_from("Q", body, pos)
            if size:
                stack = body[pos + 8 : pos + 8 + size]
                (dyn,) = struct.unpack_from("Q", body, pos + 8 + size)
                read = _with_stack(regs.get("rsp", 0), stack[:dyn], self.read)
        if regs:
            values = tuple(fetch_value(f, regs, read) for f in point.spec.fetches)
        else:
            values = (None,) * len(point.spec.fetches)
        retval = None
        if point.is_return and regs:
            rax = regs["rax"]
            retval = rax - 2**64 if rax >> 63 else rax
        return Hit(time_ns, tid, probe, values, retval)


def _with_stack(
    rsp: int, stack: bytes, read: Callable[[int, int], bytes | None]
) -> Callable[[int, int], bytes | None]:
    """Reads that the stack copy taken at the hit can answer come from it."""

    def reader(address: int, n: int) -> bytes | None:
        if rsp <= address and address + n <= rsp + len(stack):
            return stack[address - rsp : address - rsp + n]
        return read(address, n)

    return reader
