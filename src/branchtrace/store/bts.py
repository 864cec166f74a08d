"""The seed's ptrace BTS API, per task, over a store file.

=========================  ==========================
seed request               TaskTrace
=========================  ==========================
PTRACE_BTS_CONFIG          config(size_bytes, flags)
PTRACE_BTS_STATUS          status()
PTRACE_BTS_SIZE            size()
PTRACE_BTS_GET i           get(i)   (0 = newest)
PTRACE_BTS_CLEAR           clear()
PTRACE_BTS_DRAIN           drain()  (oldest to newest, then clear)
=========================  ==========================

A TaskTrace is the tracer's side of one task's buffer: it configures the store and reads
it; the engine in (or beside) the task is the ring's writer.  Errors mirror the seed's
errnos as typed exceptions (see branchtrace.errors).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError, NoBufferError, NotSupportedError, OverCapError
from .format import MIN_DATA_SIZE, Flags, Mode
from .records import parse_words
from .ring import Ring, RingReader

ALL_FLAGS = Flags.TRACE | Flags.SCHED | Flags.SIGNAL | Flags.CUT_SIZE | Flags.DROP

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse `16M`, `512KiB`, `1g`, `4096` into bytes (binary multiples)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise InvalidArgumentError(f"bad size {text!r}", hint="write it like 4096, 512K, 16M or 1G")
    return int(m.group(1)) << (10 * " kmgt".index((m.group(2) or " ").lower()))


def floor_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class MemoryCap:
    """Accounting of trace buffer memory, like RLIMIT_MEMLOCK for the seed's buffers.

    The default limit is a quarter of physical memory, or BRANCHTRACE_MEMLOCK (a size such
    as `2G`) when that is set.  Every TaskTrace charges its ring's data size here.
    """

    def __init__(self, limit_bytes: int | None = None) -> None:
        if limit_bytes is None:
            env = os.environ.get("BRANCHTRACE_MEMLOCK")
            limit_bytes = parse_size(env) if env else _physical_memory() // 4
        self.limit = limit_bytes
        self._charges: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return sum(self._charges.values())

    def available(self, owner: object) -> int:
        """Bytes `owner` may use, counting what it already holds as available."""
        with self._lock:
            return self.limit - self.used + self._charges.get(id(owner), 0)

    def charge(self, owner: object, nbytes: int) -> None:
        with self._lock:
            if self.used - self._charges.get(id(owner), 0) + nbytes > self.limit:
                raise OverCapError(
                    f"a {nbytes}-byte buffer would exceed the {self.limit}-byte trace memory cap",
                    hint="use a smaller size, CUT_SIZE, or raise BRANCHTRACE_MEMLOCK",
                )
            self._charges[id(owner)] = nbytes

    def release(self, owner: object) -> None:
        with self._lock:
            self._charges.pop(id(owner), None)


DEFAULT_CAP = MemoryCap()


@dataclass(frozen=True)
class Status:
    """What PTRACE_BTS_STATUS returned, and a little more."""

    size_bytes: int  #: ring data size, bytes (a power of two)
    flags: Flags
    mode: Mode
    lost_records: int  #: records dropped so far (drop mode); always 0 in wrap and stream
    writer_pid: int  #: the pid that owns (or last owned) the writing side, 0 if none


def _mode_for(flags: Flags) -> Mode:
    if flags & Flags.DROP:
        return Mode.DROP
    if flags & Flags.SIGNAL:
        return Mode.STREAM
    return Mode.WRAP


class TaskTrace:
    """One task's branch trace buffer, kept in the store file at `path` (by default
    `/dev/shm/branchtrace-<pid>-<tid>.bts`).

    If the file exists it is opened; otherwise there is no buffer until :meth:`config`.
    `supported` names the flags the engine behind this trace can honour; asking for
    another raises NotSupportedError (the seed's EOPNOTSUPP).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        tid: int = 0,
        cap: MemoryCap | None = None,
        supported: Flags = ALL_FLAGS,
        notify_signal: int = int(signal.SIGIO),
    ) -> None:
        if path is None:
            path = (
                Path("/dev/shm")
                / f"branchtrace-{os.getpid()}-{tid or threading.get_native_id()}.bts"
            )
        self.path = Path(path)
        self.tid = tid
        self.cap = cap or DEFAULT_CAP
        self.supported = supported
        self.notify_signal = notify_signal
        self._ring: Ring | None = None
        self._reader: RingReader | None = None
        if self.path.exists():
            self._ring = Ring.open(self.path, writable=True)
            self.cap.charge(self, self._ring.data_size)

    # -- PTRACE_BTS_CONFIG -------------------------------------------------------------------

    def config(self, size_bytes: int, flags: Flags = Flags.TRACE) -> None:
        """Configure the buffer: `size_bytes` rounded down to a power of two (at least
        4096; 0 frees the buffer).  A new, empty buffer only when the size changes;
        otherwise the flags and mode change in place and the records stay.
        """
        flags = Flags(flags) if isinstance(flags, int) else flags
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise InvalidArgumentError(f"bad buffer size {size_bytes!r}")
        if int(flags) & ~int(ALL_FLAGS):
            raise InvalidArgumentError(f"unknown flags {int(flags) & ~int(ALL_FLAGS):#x}")
        unsupported = flags & ~self.supported
        if unsupported:
            raise NotSupportedError(
                f"this engine cannot do {unsupported!r}",
                hint="drop the flag or use another engine",
            )
        if size_bytes == 0:
            self._free()
            return
        size = floor_power_of_two(size_bytes)
        available = self.cap.available(self)
        if size > available:
            if not flags & Flags.CUT_SIZE:
                self.cap.charge(self, size)  # raises OverCapError with the message
            size = floor_power_of_two(available)
        if size < MIN_DATA_SIZE:
            raise (OverCapError if size_bytes >= MIN_DATA_SIZE else InvalidArgumentError)(
                f"buffer size {size_bytes} is below the {MIN_DATA_SIZE}-byte minimum"
                + (" after clamping to the memory cap" if size_bytes >= MIN_DATA_SIZE else "")
            )
        mode = _mode_for(flags)
        if self._ring is not None and self._ring.data_size == size:
            if mode == Mode.WRAP and self._ring.mode != Mode.WRAP:
                self._drop_reader()
            self._ring._set("mode", mode)
            self._ring._set("flags", flags)
            self._ring._set("notify_signal", self.notify_signal if flags & Flags.SIGNAL else 0)
            return
        self.cap.charge(self, size)
        self._close_ring()
        try:
            self._ring = Ring.create(
                self.path,
                size,
                mode,
                flags,
                tid=self.tid,
                notify_signal=self.notify_signal if flags & Flags.SIGNAL else 0,
            )
        except BaseException:
            self.cap.release(self)
            raise

    # -- the other requests ------------------------------------------------------------------

    def status(self) -> Status:
        ring = self._need_ring()
        return Status(ring.data_size, ring.flags, ring.mode, ring.lost_records, ring.writer_pid)

    def size(self) -> int:
        """Number of records available (PAD excluded; LOST records count as records)."""
        return int(self._read().size)

    def get(self, index: int) -> np.void:
        """Record `index`: 0 is the newest, higher is older."""
        records = self._read()
        if not isinstance(index, int) or not 0 <= index < records.size:
            raise InvalidArgumentError(
                f"record index {index} out of range: {records.size} records available"
            )
        return records[records.size - 1 - index]

    def clear(self) -> None:
        """Empty the buffer."""
        ring = self._need_ring()
        self._release_up_to(ring.head)

    def drain(self) -> np.ndarray:
        """All records, oldest to newest (RECORD_DTYPE), then clear what was returned."""
        ring = self._need_ring()
        reader = self._reader or RingReader(ring)
        words, pos = reader.read_words()
        records = parse_words(ring.expand(words), pos, where=str(ring.path))
        self._release_up_to(pos + words.size * 8)
        return records

    def close(self) -> None:
        """Let go of the store file (it stays on disk)."""
        self._close_ring()
        self.cap.release(self)

    def __enter__(self) -> TaskTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def ring(self) -> Ring:
        return self._need_ring()

    # -- internals ---------------------------------------------------------------------------

    def _need_ring(self) -> Ring:
        if self._ring is None:
            raise NoBufferError(
                f"task {self.tid or '?'} has no trace buffer",
                hint="configure one with config(size, flags)",
            )
        return self._ring

    def _read(self) -> np.ndarray:
        ring = self._need_ring()
        return (self._reader or RingReader(ring)).read()

    def _release_up_to(self, pos: int) -> None:
        ring = self._need_ring()
        if ring.mode == Mode.WRAP:
            # The writer owns data_tail in wrap mode; the owner's clear position hides
            # what was cleared without touching it.
            if pos > ring._get("clear_pos"):
                ring._set("clear_pos", pos)
            return
        if self._reader is None:
            self._reader = RingReader(ring, consume=True)
        self._reader.advance(pos)

    def _drop_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _close_ring(self) -> None:
        self._drop_reader()
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def _free(self) -> None:
        self._close_ring()
        self.cap.release(self)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
