"""The shared ring: a store file mapped by one writer and any number of readers.

Concurrency model (see docs/format.md for the full contract):

* One writer per ring, enforced by an open-file-description lock on byte 0 of the file
  (released by the kernel when the writer dies, however it dies).  The writer's pid is in
  the header so a second writer is told who owns the ring.
* The writer claims the data area one chunk at a time.  No record straddles a chunk
  boundary (the writer pads with PAD words), so every chunk boundary is a record boundary.
  In wrap mode it first moves data_tail past the old records the chunk held.  Then it
  either zeroes the chunk, or (an inline writer) keeps its write pointer in the header
  (`inline_ptr`, advanced after each record's words are stored; `inline_base` non-zero).
  A late reader therefore always starts at an intact record and never returns a record
  that was being written when the writer died.
* A ring with a block table (version 3, `table_size` > 0) holds 4-byte block ids, two to
  a word, written by an inline writer only; readers expand them (:meth:`Ring.expand`).
* data_head is published after every record by the Python and C writers; an inline
  writer may publish it less often, and a reader of a dead writer recovers the records
  past data_head in the claimed chunk: up to `inline_ptr`, or to the first zero word.
* stream: at a chunk boundary the writer waits until the consumer has freed a whole chunk
  (futex on `tail_seq`; the consumer gets a futex wake on `head_seq` and, if configured,
  a signal).  drop: the writer never waits; records it cannot place are counted in
  `lost_records` and announced by a LOST record once space returns.
* A consuming reader (one that writes data_tail) holds an OFD lock on byte 1; wrap mode
  refuses it, because there the writer owns data_tail.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ..errors import (
    BusyError,
    CorruptStoreError,
    InvalidArgumentError,
    ModeConflictError,
    NoMemoryError,
    StoreError,
)
from .format import (
    DEFAULT_META_SIZE,
    HEADER_DTYPE,
    HEADER_SIZE,
    MAGIC,
    MAX_BLOCK_ID,
    MAX_CHUNK_SIZE,
    MAX_RING_PAYLOAD,
    MIN_DATA_SIZE,
    READABLE_VERSIONS,
    VERSION,
    WORD,
    Flags,
    Mode,
    RecordType,
    WriterState,
    meta_entry,
    record_words,
)
from .records import MetaEntry, expand_slots, parse_meta, parse_words

_WRITER_LOCK_BYTE = 0
_CONSUMER_LOCK_BYTE = 1
_PAD_WORD = np.uint64(1 << 63)
#: an inline writer with a block table keeps its pointer this far past its last slot
#: (each slot is stored as 8 bytes at pointer - 4: the id, then a zero for the next slot)
SLOT_LEAD = 4
_U64 = np.uint64
_MADV_POPULATE_READ = 22

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_FUTEX = 202
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _libc.syscall(
        _SYS_FUTEX,
        ctypes.c_void_p(addr),
        _FUTEX_WAIT,
        ctypes.c_uint32(expected),
        ctypes.byref(ts),
        None,
        0,
    )


_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2
_PAGE = 4096


def _punch_hole(fd: int, start: int, end: int) -> int:
    """Free the file's blocks in [start, end) rounded inward to pages (they read as zeros
    after); the bytes freed, 0 where the file system cannot punch holes."""
    start = -(-start // _PAGE) * _PAGE
    end = end // _PAGE * _PAGE
    if end <= start:
        return 0
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if _libc.fallocate(fd, mode, ctypes.c_int64(start), ctypes.c_int64(end - start)) != 0:
        return 0
    return end - start


def _futex_wake(addr: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def _ofd_lock(fd: int, byte: int, *, query: bool = False) -> int:
    """Take (or with `query`, test) an OFD write lock on one byte.

    Returns 0 on success, or -1 if someone else holds it.  OFD locks belong to the open
    file description, so they conflict even within one process and die with their owner.
    """
    lk = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0)
    cmd = fcntl.F_OFD_GETLK if query else fcntl.F_OFD_SETLK
    try:
        res = fcntl.fcntl(fd, cmd, lk)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return -1
        raise
    if query:
        return 0 if struct.unpack("hhqqi4x", res)[0] == fcntl.F_UNLCK else -1
    return 0


def _ofd_unlock(fd: int, byte: int) -> None:
    lk = struct.pack("hhqqi4x", fcntl.F_UNLCK, os.SEEK_SET, byte, 1, 0)
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lk)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def default_chunk_size(data_size: int) -> int:
    """An eighth of the ring, at most 64 KiB: wrap mode keeps at least 7/8 of the ring."""
    return min(MAX_CHUNK_SIZE, data_size // 8)


class Ring:
    """A mapped store file.  Use :class:`RingWriter` / :class:`RingReader` to use it."""

    def __init__(self, path: str | os.PathLike[str], fd: int, mm: mmap.mmap) -> None:
        self.path = Path(path)
        self.fd = fd
        self._mm = mm
        self._hdr = np.frombuffer(mm, HEADER_DTYPE, count=1)
        h = self._hdr[0]
        self.data_size = int(h["data_size"])
        self.chunk_size = int(h["chunk_size"])
        self.meta_size = int(h["meta_size"])
        self._data = np.frombuffer(mm, _U64, count=self.data_size // WORD, offset=HEADER_SIZE)
        self._meta = np.frombuffer(
            mm, np.uint8, count=self.meta_size, offset=HEADER_SIZE + self.data_size
        )
        self.table_size = int(h["table_size"]) if int(h["version"]) >= 3 else 0
        self._table = np.frombuffer(
            mm, _U64, count=self.table_size // WORD, offset=int(h["table_offset"] or 0)
        )
        self._base_addr = self._hdr.ctypes.data

    # -- creation and opening ------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        data_size: int,
        mode: Mode = Mode.WRAP,
        flags: Flags = Flags.TRACE,
        *,
        meta_size: int = DEFAULT_META_SIZE,
        chunk_size: int | None = None,
        tid: int = 0,
        notify_signal: int = 0,
        table_entries: int = 0,
    ) -> Ring:
        """Create a new store file (replacing any old one at `path`).

        `data_size` is in bytes, a power of two >= 4096.  `table_entries` > 0: a block
        table of that many entries for an inline writer's 4-byte block ids (entry 0, the
        empty slot, is never used).  The file's blocks are allocated
        up front, so a full /dev/shm fails here with NoMemoryError instead of killing the
        writer with SIGBUS later.
        """
        if not is_power_of_two(data_size) or data_size < MIN_DATA_SIZE:
            raise InvalidArgumentError(
                f"ring size {data_size} must be a power of two of at least {MIN_DATA_SIZE} bytes"
            )
        chunk = chunk_size or default_chunk_size(data_size)
        if not is_power_of_two(chunk) or chunk > data_size or chunk < (MAX_RING_PAYLOAD + 2) * WORD:
            raise InvalidArgumentError(f"chunk size {chunk} does not fit ring size {data_size}")
        meta_size = -(-meta_size // WORD) * WORD
        if not 0 <= table_entries <= MAX_BLOCK_ID + 1:
            raise InvalidArgumentError(f"a block table holds at most {MAX_BLOCK_ID + 1} entries")
        table_size = table_entries * WORD
        total = HEADER_SIZE + data_size + meta_size + table_size
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:  # kept as the cause: a recorder out of descriptors makes room
            raise StoreError(f"cannot create {path}: {e.strerror}") from e
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise NoMemoryError(
                        f"no room for a {total}-byte store at {path}: {e.strerror}",
                        hint=f"use a smaller --buffer-size, or free space in {path.parent}",
                    ) from None
                raise StoreError(f"cannot allocate {path}: {e.strerror}") from None
            hdr = np.zeros(1, HEADER_DTYPE)
            h = hdr[0]
            h["magic"] = MAGIC
            h["version"] = VERSION
            h["header_size"] = HEADER_SIZE
            h["data_offset"] = HEADER_SIZE
            h["data_size"] = data_size
            h["chunk_size"] = chunk
            h["meta_offset"] = HEADER_SIZE + data_size
            h["meta_size"] = meta_size
            if table_size:
                h["table_offset"] = HEADER_SIZE + data_size + meta_size
                h["table_size"] = table_size
            h["mode"] = mode
            h["flags"] = flags
            h["tid"] = tid
            h["notify_signal"] = notify_signal
            h["created_ns"] = time.time_ns()
            os.pwrite(fd, hdr.tobytes(), 0)
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        try:
            return cls._map(path, fd, total, writable=True)
        except NoMemoryError:
            # mmap() takes a descriptor of its own, so a recorder out of them got here with
            # the file made: it stayed (.spare rings left in a recording, under --sched)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, writable: bool = False) -> Ring:
        """Open an existing store; a file that is not one raises CorruptStoreError."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            raise StoreError(f"{path}: no such store") from None
        except OSError as e:
            raise StoreError(f"cannot open {path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, HEADER_SIZE, 0)
            total = _validate_header(path, head, size)
            return cls._map(path, fd, total, writable=writable)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _map(cls, path: Path, fd: int, total: int, *, writable: bool) -> Ring:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=prot)
        except OSError as e:
            os.close(fd)
            raise NoMemoryError(f"cannot map {path}: {e.strerror}") from e
        return cls(path, fd, mm)

    def close(self) -> None:
        if self.fd < 0:
            return
        del self._hdr, self._data, self._meta, self._table
        # Views handed out earlier (records being read, a writer's data) keep the mapping
        # alive; it is unmapped when the last of them goes.
        with contextlib.suppress(BufferError):
            self._mm.close()
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- header access ---------------------------------------------------------------------

    def _get(self, field: str) -> int:
        return int(self._hdr[field][0])

    def _set(self, field: str, value: int) -> None:
        self._hdr[field] = value

    def _addr(self, field: str) -> int:
        fields = HEADER_DTYPE.fields
        assert fields is not None
        return self._base_addr + fields[field][1]

    @property
    def mode(self) -> Mode:
        return Mode(self._get("mode"))

    @property
    def flags(self) -> Flags:
        return Flags(self._get("flags"))

    @property
    def head(self) -> int:
        return self._get("data_head")

    @property
    def tail(self) -> int:
        return self._get("data_tail")

    @property
    def lost_records(self) -> int:
        return self._get("lost_records")

    @property
    def writer_pid(self) -> int:
        return self._get("writer_pid")

    @property
    def writer_state(self) -> WriterState:
        return WriterState(self._get("writer_state"))

    @property
    def tid(self) -> int:
        return self._get("tid")

    @property
    def created_ns(self) -> int:
        """When the ring was made, or taken for its thread (wall clock, time.time_ns)."""
        return self._get("created_ns")

    def header(self) -> dict[str, int | bytes]:
        """All header fields, for `branchtrace info` and debugging."""
        h = self._hdr[0]
        return {name: (h[name].item()) for name in HEADER_DTYPE.names or ()}

    def prefault(self, data_bytes: int, table_bytes: int) -> None:
        """Read the header, the first `data_bytes` of the data area and of the block table
        into memory, so that a writer's first records there do not wait for them.  On a
        disk file system the first write to a page of the file not yet in memory reads it,
        with the disk's readahead: 2.4-4 ms for one page of a new 18 MiB ring here (its
        read_ahead_kb is 8192), against 7 us once read in.  Reading it all in costs 6 ms,
        which a short thread never needs.  The readahead is turned off meanwhile: with
        it, reading in the first MiB read in 8 MiB (2.6-4.6 ms, against 0.9 ms).  Before
        Linux 5.14 (no MADV_POPULATE_READ), it does nothing."""
        areas = [(0, HEADER_SIZE + min(data_bytes, self.data_size))]
        if self.table_size:
            areas.append((self._get("table_offset"), min(table_bytes, self.table_size)))
        with contextlib.suppress(OSError):
            self._mm.madvise(mmap.MADV_RANDOM)
            try:
                for start, length in areas:
                    offset = start // mmap.PAGESIZE * mmap.PAGESIZE
                    self._mm.madvise(_MADV_POPULATE_READ, offset, start + length - offset)
            finally:
                self._mm.madvise(mmap.MADV_NORMAL)

    def writer_alive(self) -> bool:
        """True while some process holds the writer lock."""
        return _ofd_lock(self.fd, _WRITER_LOCK_BYTE, query=True) != 0

    def release_unused(self, *, drained: bool = False) -> int:
        """Give the file system back the blocks that `create` allocated and no record
        needs: the data area past the last chunk the writer claimed (when it never wrapped),
        the block table past its last entry and the metadata log past its head.  With
        `drained` (a consumer has taken every record, the final ones past data_head too),
        the whole data area.  Returns the bytes released.

        Only once the writer will never write again: it closed the ring, or no process
        holds the writer lock (it goes with the last descriptor and mapping of the file);
        else nothing is released.  Every read gives the same records after as before: what
        is released held zeros (never written) or records already taken.
        """
        if self.writer_state != WriterState.CLOSED and self.writer_alive():
            return 0
        get, data_size = self._get, self.data_size
        used = data_size
        if drained:
            if self.head == self.tail:
                used = 0
        elif get("claim_end") < data_size:
            used = max(get("claim_end"), self.head)
        areas = [
            (HEADER_SIZE, used, data_size),
            (get("meta_offset"), get("meta_head"), get("meta_size")),
            (get("table_offset"), get("table_count") * WORD, get("table_size")),
        ]
        return sum(
            _punch_hole(self.fd, offset + used, offset + size)
            for offset, used, size in areas
            if size and used < size
        )

    def expand(self, words: np.ndarray | Sequence[np.ndarray]) -> np.ndarray:
        """`words` of this ring's stream (read from it or drained from it, starting at a
        record boundary; or a sequence of such arrays, one after the other) with block ids
        turned into BLOCK words; as they are if the ring has no block table."""
        if not self.table_size:
            if isinstance(words, np.ndarray):
                return words
            return np.concatenate(list(words)) if len(words) != 1 else words[0]
        table = self._table[: min(self._get("table_count"), self._table.size)]
        return expand_slots(words, table, where=str(self.path))


def _validate_header(path: Path, raw: bytes, file_size: int) -> int:
    def bad(why: str) -> CorruptStoreError:
        return CorruptStoreError(
            f"{path}: not a valid branchtrace store ({why})",
            hint="pass a store written by branchtrace, or record again",
        )

    if len(raw) < HEADER_SIZE:
        raise bad(f"file is {file_size} bytes, shorter than the {HEADER_SIZE}-byte header")
    h = np.frombuffer(raw, HEADER_DTYPE, count=1)[0]
    if bytes(h["magic"]) != MAGIC.rstrip(b"\0"):
        raise bad("bad magic")
    if int(h["version"]) not in READABLE_VERSIONS:
        raise bad(f"format version {int(h['version'])}, this branchtrace reads {VERSION}")
    data_size, chunk = int(h["data_size"]), int(h["chunk_size"])
    meta_off, meta_size = int(h["meta_offset"]), int(h["meta_size"])
    if int(h["header_size"]) != HEADER_SIZE or int(h["data_offset"]) != HEADER_SIZE:
        raise bad("unexpected header size")
    if not is_power_of_two(data_size) or data_size < MIN_DATA_SIZE:
        raise bad(f"ring size {data_size} is not a power of two >= {MIN_DATA_SIZE}")
    if not is_power_of_two(chunk) or chunk > data_size or chunk < (MAX_RING_PAYLOAD + 2) * WORD:
        raise bad(f"chunk size {chunk}")
    if meta_off != HEADER_SIZE + data_size or meta_size % WORD:
        raise bad("metadata area misplaced")
    total = meta_off + meta_size
    if int(h["version"]) >= 3 and int(h["table_size"]):
        table_off, table_size = int(h["table_offset"]), int(h["table_size"])
        if table_off != total or table_size % WORD:
            raise bad("block table misplaced")
        if int(h["table_count"]) > table_size // WORD:
            raise bad("block table count beyond the table")
        total += table_size
    if file_size < total:
        raise bad(f"truncated: {file_size} bytes, the header describes {total}")
    if int(h["mode"]) not in tuple(Mode):
        raise bad(f"unknown mode {int(h['mode'])}")
    head, tail = int(h["data_head"]), int(h["data_tail"])
    if tail > head or head - tail > data_size or head % WORD or tail % WORD:
        raise bad(f"inconsistent positions head={head} tail={tail}")
    if int(h["meta_head"]) > meta_size:
        raise bad("metadata head beyond the metadata area")
    return total


def recovered_head(ring: Ring, *, live: bool = False) -> int:
    """data_head, extended over records written past it in the claimed chunk.

    An inline writer publishes data_head lazily and any writer can die between writing a
    record and publishing it.  When no writer holds the ring any more, the words after
    data_head are recovered up to the inline writer's pointer (`inline_ptr`, stored after
    each record's words, in the writer's address space relative to `inline_base`) when it
    keeps one, else up to the first zero word (such a writer zeroes each chunk it claims
    and writes a record's header last).  Either way they are whole records; if they do not
    parse, nothing is recovered: a torn record is never returned.

    `live`: recover from a writer that is alive too (a snapshot while the thread waits, or
    keeps running: BLOCK records are single aligned words and an escape record's header is
    written last, so the words before the first zero are still whole records).
    """
    head = ring.head
    claim = ring._get("claim_end")
    if claim <= head or ring.writer_state == WriterState.CLOSED:
        return head
    if ring.writer_alive() and not live:
        return head
    at = (head & (ring.data_size - 1)) // WORD
    base = ring._get("inline_base")
    if base:  # the writer did not zero the chunk: its write pointer says where words end
        chunk_start = claim - ring.chunk_size
        ptr = ring._get("inline_ptr") - (SLOT_LEAD if ring.table_size else 0)
        end = chunk_start + ptr - base - (chunk_start & (ring.data_size - 1))
        # a word holding one slot is whole: each slot is stored as 8 bytes, its id and
        # a zero for the slot after it
        end = -(-end // WORD) * WORD
        if not head <= end <= claim:  # dropping (pointing at its scratch chunk), or closed
            return head
        words = ring._data[at : at + (end - head) // WORD]
        n = words.size
    else:
        words = ring._data[at : at + (claim - head) // WORD]
        zero = np.flatnonzero(words == 0)
        n = int(zero[0]) if zero.size else words.size
    try:
        parse_words(words[:n], head)
    except CorruptStoreError:
        return head
    return head + n * WORD


class RingWriter:
    """The one writer of a ring (the Python one; the C writer in `bt_writer.h` is its twin).

    `stall_timeout` bounds how long a stream-mode write waits for the consumer (None:
    forever, the guaranteed-flow contract); on expiry TimeoutError is raised and nothing is
    lost (the record was not written).
    """

    def __init__(self, ring: Ring, *, stall_timeout: float | None = None) -> None:
        self.ring = ring
        self.stall_timeout = stall_timeout
        if _ofd_lock(ring.fd, _WRITER_LOCK_BYTE) != 0:
            raise BusyError(
                f"{ring.path} is already being written by pid {ring.writer_pid}",
                hint="only one tool can trace a task; read it instead, or stop the other",
            )
        self._size = ring.data_size
        self._mask = ring.data_size - 1
        self._chunk = ring.chunk_size
        self._mode = ring.mode
        self._data = ring._data
        # Keep what an earlier writer left past its published head, then start claiming
        # afresh at the next chunk boundary.
        if ring.table_size:
            _ofd_unlock(ring.fd, _WRITER_LOCK_BYTE)
            raise ModeConflictError(
                f"{ring.path} holds block ids: only an inline writer (the stalker engine) writes it"
            )
        self._head = recovered_head(ring)
        self._claim_end = ring._get("claim_end")
        if self._head < self._claim_end:
            self._pad_to_boundary()
        ring._set("data_head", self._head)
        ring._set("inline_base", 0)  # this writer zeroes the chunks it claims
        self._pending_lost = 0
        ring._set("writer_pid", os.getpid())
        ring._set("writer_state", WriterState.ACTIVE)

    # -- records ---------------------------------------------------------------------------

    def write(self, rtype: int, arg: int = 0, *payload: int) -> bool:
        """Write one record; see format.record_words for the meaning of arg and payload.

        Returns False if the record was dropped (drop mode, ring full); it is counted.
        """
        return self.write_words(record_words(rtype, arg, *payload))

    def write_words(self, words: Sequence[int]) -> bool:
        """Write one already-encoded record (1 to 63 words)."""
        if self._pending_lost and not self._flush_lost(len(words)):
            self._lose(1)
            return False
        if not self._reserve(len(words)):
            self._lose(1)
            return False
        self._store(words)
        return True

    def write_blocks(self, words: np.ndarray) -> int:
        """Write many one-word BLOCK records (bit 63 clear, non-zero) in bulk.

        Returns how many were written; in drop mode the rest were counted as lost.
        """
        words = np.ascontiguousarray(words, dtype=_U64)
        written = 0
        i, n = 0, words.size
        while i < n:
            if self._pending_lost and not self._flush_lost(1):
                lost = self._skip_unplaceable(n - i)
                self._lose(lost)
                i += lost
                continue
            if not self._reserve(1):
                lost = self._skip_unplaceable(n - i)
                self._lose(lost)
                i += lost
                continue
            room = (self._claim_end - self._head) // WORD
            k = min(room, n - i)
            at = (self._head & self._mask) // WORD
            self._data[at : at + k] = words[i : i + k]
            self._head += k * WORD
            self.ring._set("data_head", self._head)
            written += k
            i += k
        return written

    def _skip_unplaceable(self, remaining: int) -> int:
        # Dropping a chunk's worth at a time keeps a full ring from costing a Python
        # iteration per record; each one is still counted.
        return min(remaining, self._chunk // WORD)

    def write_meta(self, rtype: RecordType, fixed: Iterable[int], data: bytes = b"") -> bool:
        """Append to the metadata log (never overwritten).  False if the log is full."""
        entry = meta_entry(rtype, self._head, time.time_ns(), list(fixed), data)
        mh = self.ring._get("meta_head")
        if mh + len(entry) > self.ring.meta_size:
            self.ring._set("meta_lost", self.ring._get("meta_lost") + 1)
            return False
        self.ring._meta[mh : mh + len(entry)] = np.frombuffer(entry, np.uint8)
        self.ring._set("meta_head", mh + len(entry))
        return True

    def flush(self) -> None:
        """Publish data_head and wake a waiting reader."""
        self.ring._set("data_head", self._head)
        self._wake_reader()

    def close(self) -> None:
        """Publish everything, mark the ring cleanly closed and release it."""
        if self._pending_lost:
            self._flush_lost(0)
        self.ring._set("data_head", self._head)
        self.ring._set("writer_state", WriterState.CLOSED)
        self._wake_reader()
        _ofd_unlock(self.ring.fd, _WRITER_LOCK_BYTE)
        del self._data

    def __enter__(self) -> RingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _lose(self, n: int) -> None:
        self._pending_lost += n
        self.ring._set("lost_records", self.ring._get("lost_records") + n)

    def _flush_lost(self, then_words: int) -> bool:
        """Place the LOST record announcing the pending losses, if it and the next record fit."""
        lost = record_words(RecordType.LOST, 0, self._pending_lost)
        if not self._reserve(len(lost) + then_words):
            return False
        self._store(lost)
        self.ring._set("lost_events", self.ring._get("lost_events") + 1)
        self._pending_lost = 0
        return True

    def _store(self, words: Sequence[int]) -> None:
        at = (self._head & self._mask) // WORD
        n = len(words)
        if n > 1:  # payload first, header last: a torn record has a zero header
            self._data[at + 1 : at + n] = words[1:]
        self._data[at] = words[0]
        self._head += n * WORD
        self.ring._set("data_head", self._head)

    def _pad_to_boundary(self) -> None:
        left = (-self._head) % self._chunk // WORD
        if left:
            at = (self._head & self._mask) // WORD
            self._data[at : at + left] = _PAD_WORD
            self._head += left * WORD

    def _reserve(self, nwords: int) -> bool:
        """Make room for `nwords` contiguous words at head; False if drop mode must drop."""
        if self._head + nwords * WORD <= self._claim_end:
            return True
        if self._head < self._claim_end:
            self._pad_to_boundary()
        return self._claim()

    def _claim(self) -> bool:
        """Claim the chunk starting at head (a chunk boundary)."""
        start = self._head
        end = start + self._chunk
        if self._mode == Mode.WRAP:
            new_tail = end - self._size
            if new_tail > self.ring.tail:
                self.ring._set("data_tail", new_tail)
        elif end - self.ring.tail > self._size and (
            self._mode == Mode.DROP or not self._wait_for_space(end)
        ):
            self.ring._set("data_head", self._head)
            return False
        at = (start & self._mask) // WORD
        self._data[at : at + self._chunk // WORD] = 0
        self._claim_end = end
        self.ring._set("claim_end", end)
        self.ring._set("data_head", self._head)
        self._wake_reader()
        return True

    def _wait_for_space(self, end: int) -> bool:
        """Wait for the consumer to free the chunk ending at `end`.

        False if the consumer is gone (its lock was released): the ring then turns into a
        drop ring, so a writer never waits for a tool that no longer exists.
        """
        ring = self.ring
        ring._set("writer_waits", ring._get("writer_waits") + 1)
        deadline = None if self.stall_timeout is None else time.monotonic() + self.stall_timeout
        rounds = 0
        while True:
            seq = ring._get("tail_seq")
            ring._set("writer_waiting", 1)
            if end - ring.tail <= self._size:
                break
            ring._set("data_head", self._head)
            self._wake_reader()
            consumer, sig = ring._get("consumer_pid"), ring._get("notify_signal")
            if consumer and sig:
                with contextlib.suppress(OSError):
                    os.kill(consumer, sig)
            wait = 0.1
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    ring._set("writer_waiting", 0)
                    raise TimeoutError(f"{ring.path}: the consumer freed no space")
            if rounds and _ofd_lock(ring.fd, _CONSUMER_LOCK_BYTE, query=True) == 0:
                ring._set("writer_waiting", 0)
                self._mode = Mode.DROP
                ring._set("mode", Mode.DROP)
                return False
            rounds += 1
            _futex_wait(ring._addr("tail_seq"), seq, wait)
        ring._set("writer_waiting", 0)
        return True

    def _wake_reader(self) -> None:
        ring = self.ring
        ring._set("head_seq", (ring._get("head_seq") + 1) & 0xFFFFFFFF)
        if ring._get("reader_waiting"):
            _futex_wake(ring._addr("head_seq"))


class RingReader:
    """A reader.  With `consume=True` it owns data_tail (stream and drop modes only)."""

    def __init__(self, ring: Ring, *, consume: bool = False) -> None:
        self.ring = ring
        self.consume = consume
        if consume:
            if ring.mode == Mode.WRAP:
                raise ModeConflictError(
                    f"{ring.path} is in wrap mode: its writer owns data_tail, so it cannot "
                    "be consumed",
                    hint="open it read-only, or record in stream mode",
                )
            if _ofd_lock(ring.fd, _CONSUMER_LOCK_BYTE) != 0:
                raise BusyError(
                    f"{ring.path} already has a consumer, pid {ring._get('consumer_pid')}"
                )
            ring._set("consumer_pid", os.getpid())

    def close(self) -> None:
        if self.consume:
            _ofd_unlock(self.ring.fd, _CONSUMER_LOCK_BYTE)
            self.consume = False

    def __enter__(self) -> RingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_words(self, *, start: int | None = None, live: bool = False) -> tuple[np.ndarray, int]:
        """Copy the valid words: returns (words, stream position of words[0]).

        Start defaults to the oldest valid record (max of data_tail and the owner's
        clear position).  Records the writer overwrote during the copy are dropped.
        `live`: include what a live writer wrote but has not published (see recovered_head).
        """
        ring = self.ring
        head = recovered_head(ring, live=live)
        tail = max(ring.tail, ring._get("clear_pos"))
        if start is not None:
            tail = max(tail, start)
        if tail >= head:
            return np.empty(0, _U64), head
        words = self._copy(tail, head)
        after = ring.tail
        if after > tail:  # overwritten while we copied (wrap mode, live writer)
            words = words[(min(after, head) - tail) // WORD :]
            tail = min(after, head)
        return words, tail

    def _copy(self, start: int, end: int) -> np.ndarray:
        mask = self.ring.data_size - 1
        a, b = (start & mask) // WORD, (end & mask) // WORD
        data = self.ring._data
        if end - start == self.ring.data_size or b <= a:
            return np.concatenate([data[a:], data[:b]])
        return data[a:b].copy()

    def read(self, *, start: int | None = None) -> np.ndarray:
        """The valid records, oldest first, as a RECORD_DTYPE array."""
        words, pos = self.read_words(start=start)
        return parse_words(self.ring.expand(words), pos, where=str(self.ring.path))

    def advance(self, pos: int) -> None:
        """Release everything before stream position `pos` to the writer."""
        if not self.consume:
            raise ModeConflictError(f"{self.ring.path}: this reader does not consume")
        ring = self.ring
        if pos > ring.tail:
            ring._set("data_tail", pos)
        ring._set("tail_seq", (ring._get("tail_seq") + 1) & 0xFFFFFFFF)
        if ring._get("writer_waiting"):
            _futex_wake(ring._addr("tail_seq"))

    def wait(self, seen_head: int, timeout: float) -> bool:
        """Wait until data_head moves past `seen_head`, the writer closes, or `timeout`.

        Returns True if there is something new to read.
        """
        ring = self.ring
        seq = ring._get("head_seq")
        ring._set("reader_waiting", 1)
        try:
            if ring.head > seen_head or ring.writer_state == WriterState.CLOSED:
                return ring.head > seen_head
            _futex_wait(ring._addr("head_seq"), seq, timeout)
            return ring.head > seen_head
        finally:
            ring._set("reader_waiting", 0)

    def meta(self) -> list[MetaEntry]:
        """The metadata log: module loads, thread names... (never overwritten)."""
        ring = self.ring
        n = ring._get("meta_head")
        return parse_meta(ring._meta[:n].tobytes(), where=f"{ring.path} metadata")
