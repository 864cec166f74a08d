"""A recording on disk: the directory `branchtrace record` writes and every view reads.

    DIR/meta.json        what was recorded: engine, mode, program, pid, how it ended, threads
    DIR/modules.jsonl    module loads and unloads, in order (never lost to wrap-around)
    DIR/T<tid>.bts       one store per thread (docs/format.md); T<tid>#2.bts for the
                         second thread with that id (see below)
    DIR/T<tid>.stream    stream mode: the words drained from that thread's ring, oldest first
    DIR/T<tid>.stream.lz4  the same, compressed (the default; packed.py)

A thread's record stream is its .stream file followed by what is left in its ring.

Threads are named by a key: their id, or for a thread that got the id of an earlier thread
of the same recording (ids wrap at /proc/sys/kernel/pid_max), its id plus 2^32 for each
earlier one (GENERATION); named "id#2", "id#3" in file names and views (thread_label).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreError
from .format import HEADER_SIZE, LEN_MASK, LEN_SHIFT, MAX_RING_PAYLOAD, GapReason, Mode
from .packed import SUFFIX as PACKED
from .packed import (
    append_packed,
    packed_pieces,
    packed_size,
    packed_tail,
    read_packed,
    write_all,
)
from .records import count_records
from .ring import Ring, RingReader, recovered_head

META = "meta.json"
MODULES = "modules.jsonl"
SNAPSHOTS = "snapshots"  #: `record --trigger`: one sub-directory per snapshot
_OURS = (META, MODULES, SNAPSHOTS)

#: a thread's key: its id, plus this for each earlier thread of the recording that had it
GENERATION = 1 << 32


def thread_key(tid: int, earlier: int) -> int:
    """The key of thread `tid` when `earlier` threads of the recording had its id before."""
    return tid + earlier * GENERATION


def thread_id(key: int) -> int:
    """The kernel's id of the thread named `key`."""
    return key % GENERATION


def thread_label(key: int) -> str:
    """How views name a thread: its id, "id#2" for the second thread with that id."""
    earlier = key // GENERATION
    return str(key) if earlier == 0 else f"{key % GENERATION}#{earlier + 1}"


def thread_of_file(name: str) -> int:
    """The key of the thread a file of a recording is of (T300#2.stream.lz4: 300#2);
    ValueError if it is not a thread's."""
    if not name.startswith("T"):
        raise ValueError(f"not a thread's file: {name!r}")
    return parse_thread_label(name[1:].split(".")[0])


def parse_thread_label(text: str) -> int:
    """The key a thread_label names ("id#1" is "id"); ValueError if `text` is not one."""
    match = re.fullmatch(r"([1-9][0-9]*)(?:#([1-9][0-9]*))?", text.strip())
    if match is None or int(match[1]) >= GENERATION:
        raise ValueError(f"not a thread: {text!r}")
    return thread_key(int(match[1]), int(match[2] or 1) - 1)


@dataclass(frozen=True)
class ModuleEvent:
    event: str  #: "load" or "unload"
    base: int
    size: int
    path: str
    time_ns: int
    pid: int = 0  #: the process; 0 in recordings made before --follow-fork: the main one


class TraceDir:
    def __init__(self, path: Path) -> None:
        self.path = path

    # -- writing ---------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> TraceDir:
        """Make `path` an empty trace directory.  An earlier recording there is replaced;
        a directory holding anything else is refused.  The path is made absolute: the
        traced program opens its rings by it, from a directory of its own."""
        path = Path(path).absolute()
        if path.exists():
            if not path.is_dir():
                raise StoreError(
                    f"{path} exists and is not a directory", hint="choose another output with -o"
                )
            entries = list(path.iterdir())
            foreign = [e.name for e in entries if not _is_ours(e.name)]
            if foreign:
                raise StoreError(
                    f"{path} is not a branchtrace recording (it holds {foreign[0]!r})",
                    hint="choose another output with -o",
                )
            for e in entries:
                if e.is_dir():
                    shutil.rmtree(e)
                else:
                    e.unlink()
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StoreError(
                f"cannot write to {path}: {e.strerror}",
                hint="choose a writable output directory with -o",
            ) from None
        return cls(path)

    def remove(self) -> None:
        """Undo create(): for a recording that never started."""
        shutil.rmtree(self.path, ignore_errors=True)

    def ring_path(self, tid: int) -> Path:
        return self.path / f"T{thread_label(tid)}.bts"

    def stream_path(self, tid: int, packed: bool = False) -> Path:
        return self.path / f"T{thread_label(tid)}.stream{PACKED if packed else ''}"

    def _drained(self, tid: int) -> np.ndarray | None:
        """The words drained to the thread's stream file, packed or raw, if any."""
        packed = self.stream_path(tid, packed=True)
        if packed.exists():
            return read_packed(packed)
        raw = self.stream_path(tid)
        words = raw.stat().st_size // 8 if raw.exists() else 0
        if words:
            # mapped, not read: a stream of 100M+ records is gigabytes, and the page cache
            # already holds it.  Whole words only: a recorder killed in a write leaves part
            # of one, which the ring still holds whole.
            return np.memmap(raw, dtype="<u8", mode="r", shape=(words,))
        return None

    def tail_words(self, tid: int, count: int) -> np.ndarray:
        """The end of the thread's words as `words()` gives them, at least the last `count`
        (all, if it has fewer) and from a record boundary, without reading the rest of a
        stream: how it ended."""
        drained = None
        total = 0
        packed = self.stream_path(tid, packed=True)
        if packed.exists():
            drained, total = packed_tail(packed, count)
        else:
            whole = self._drained(tid)
            if whole is not None:
                # the file starts at a record (stream position 0)
                start = _record_boundary(whole, max(whole.size - count - MAX_RING_PAYLOAD, 0))
                drained, total = np.asarray(whole[start:]), whole.size
        if not self.ring_path(tid).exists():
            return np.zeros(0, dtype="<u8") if drained is None else drained
        with Ring.open(self.ring_path(tid)) as ring:
            rest, pos = RingReader(ring).read_words()
            parts = []
            if drained is not None and drained.size:
                rest = self._after_drained(tid, drained, rest, pos, total)
                if rest.size < count:
                    parts.append(drained)
            if rest.size or not parts:
                parts.append(rest)
            words = ring.expand(parts)
        if words.size <= count + MAX_RING_PAYLOAD:
            return words
        # a ring or a piece of a stream file holds millions of words: not all wanted
        return words[_record_boundary(words, words.size - count - MAX_RING_PAYLOAD - 1) :]

    def _after_drained(
        self, tid: int, drained: np.ndarray, rest: np.ndarray, pos: int, total: int = -1
    ) -> np.ndarray:
        """The ring's words `rest`, from stream position `pos`, that follow the `drained`
        ones (the last of the `total` words in the stream file, if given).  A recorder
        killed between appending a drain to the stream file and releasing it from the ring
        (drain_to_file) leaves the file ahead of the ring: the ring still holds those
        words, which must be the file's last ones."""
        have = (drained.size if total < 0 else total) * 8
        overlap = (have - pos) // 8
        if have < pos or overlap > rest.size:
            raise StoreError(
                f"{self.stream_path(tid)}: holds {have} bytes but the ring continues at "
                f"position {pos}: the recording is incomplete"
            )
        checked = min(overlap, drained.size)  # a tail of the file holds only so many
        if checked and not np.array_equal(
            rest[overlap - checked : overlap], drained[drained.size - checked :]
        ):
            raise StoreError(
                f"{self.stream_path(tid)}: its last {overlap * 8} bytes differ from the "
                f"ring's at position {pos}: the recording is corrupt"
            )
        return rest[overlap:]

    def sched_path(self, tid: int) -> Path:
        return self.path / f"T{thread_label(tid)}.sched.npy"

    def switches(self, tid: int) -> np.ndarray | None:
        """The thread's context switches (time, cpu, out), or None if not recorded."""
        p = self.sched_path(tid)
        return np.load(p) if p.exists() else None

    def write_meta(self, meta: dict[str, Any]) -> None:
        """Write meta.json whole, or leave the one before it (a full disk: StoreError)."""
        tmp = self.path / f".{META}.tmp"
        try:
            tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
            tmp.replace(self.path / META)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(
                f"cannot write {self.path / META}: {e.strerror}",
                hint="free some space; the rings in that directory still hold the trace "
                "(branchtrace info reads them)",
            ) from None

    def append_module(self, event: ModuleEvent) -> None:
        """One line more in modules.jsonl, whole or not at all (OSError: a full disk)."""
        fd = os.open(self.path / MODULES, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                write_all(fd, (json.dumps(event.__dict__) + "\n").encode())
            except OSError:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)

    # -- reading ---------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TraceDir:
        path = Path(path)
        if not (path / META).is_file():
            if not path.exists():
                raise StoreError(
                    f"{path}: no such recording",
                    hint="record one first: branchtrace record -- PROG",
                )
            raise StoreError(f"{path} is not a branchtrace recording (no {META})")
        return cls(path)

    def meta(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.path / META).read_text()))
        except (OSError, ValueError) as e:
            raise StoreError(f"{self.path / META}: unreadable ({e})") from None

    def modules(self, pid: int | None = None) -> list[ModuleEvent]:
        """Module loads and unloads, in order: of every process, or of process `pid`."""
        p = self.path / MODULES
        if not p.exists():
            return []
        events = [ModuleEvent(**json.loads(line)) for line in p.read_text().splitlines() if line]
        if pid is None:
            return events
        main = self.meta().get("pid")
        return [e for e in events if e.pid == pid or (e.pid == 0 and pid == main)]

    def thread_pid(self, tid: int, meta: dict[str, Any] | None = None) -> int:
        """The process thread `tid` belongs to (`meta`: meta.json, if already read): its
        key, as the module records name it ("pid#2" for the image a process exec'ed)."""
        meta = self.meta() if meta is None else meta
        pid = (meta.get("threads") or {}).get(thread_label(tid), {}).get("pid")
        if pid:
            return int(pid)
        return self._process_of_ring(tid) or int(meta.get("pid") or 0)

    def _process_of_ring(self, tid: int) -> int | None:
        """For a recording that did not finish (meta.json lists no threads): the process
        of thread `tid`, from the module records, which name their process as it was
        recorded.  A process's first thread has its key; another thread's ring says which
        pid wrote it, and of the images that pid ran, it is of the last one whose modules
        were recorded before its ring was made."""
        events = self.modules()
        keys = {e.pid for e in events}
        if tid in keys:
            return tid
        try:
            with Ring.open(self.ring_path(tid)) as ring:
                writer, created = ring.writer_pid, ring.created_ns
        except (OSError, StoreError):
            return None
        first_load: dict[int, int] = {}
        for e in events:
            if e.pid % GENERATION == writer:
                first_load[e.pid] = min(first_load.get(e.pid, e.time_ns), e.time_ns)
        before = [k for k, t in first_load.items() if t <= created]
        if before:
            return max(before, key=first_load.__getitem__)
        return min(first_load, key=first_load.__getitem__) if first_load else None

    def threads(self) -> list[int]:
        """The keys of the threads recorded (thread_key), in order."""
        found = {p.name.split(".")[0] for p in self.path.glob("T*.bts")}
        found |= {p.name.split(".")[0] for p in self.path.glob("T*.stream*")}
        keys = set()
        for name in found:
            with contextlib.suppress(ValueError):  # not a store of ours
                keys.add(thread_of_file(name))
        return sorted(keys)

    def words(self, tid: int) -> tuple[np.ndarray, int]:
        """The thread's whole record stream as words, and the stream position of the first.

        Stream mode: the drained words, then the ring's rest.  Wrap mode: the ring's tail.
        """
        with self._stream_parts(tid) as (ring, parts, pos):
            if ring is None:
                return parts[0], pos
            return ring.expand(parts), pos  # one copy of the words, not two

    def record_count(self, tid: int) -> int:
        """How many records (PAD excluded) `words(tid)` holds."""
        return self.record_counts(tid)[0]

    def record_counts(self, tid: int) -> tuple[int, dict[int, int]]:
        """How many records (PAD excluded) `words(tid)` holds, and its GAP records by
        reason.  A stream whose writer kept counts in the ring's header (the stalker
        engine's agent: exact up to the position `counted_to`) has only the words after
        that position counted; else every word is, in the block slots as they are
        (expanding them loads numba's kernels, a second of `info`'s start-up) and a piece
        of the stream file at a time: expanded whole, the stream of a call loop recorded
        for 8 s (3.3 billion records, 55 MB of LZ4) took 13.3 GB of memory as the recording
        stopped at Ctrl-C."""
        kept = self._writer_counts(tid)
        if kept is not None:
            return kept
        return self._counted_in_words(self._counted_parts(tid))

    def record_counts_of_every_word(self, tid: int) -> tuple[int, dict[int, int]]:
        """record_counts without the writer's counts: each word looked at."""
        return self._counted_in_words(self._counted_parts(tid))

    @staticmethod
    def _counted_in_words(parts: Iterator[tuple[np.ndarray, bool]]) -> tuple[int, dict[int, int]]:
        records, gaps = 0, dict[int, int]()
        for part, slots in parts:
            n, g = count_records(part, slots=slots)
            records += n
            for reason, k in g.items():
                gaps[reason] = gaps.get(reason, 0) + k
        return records, gaps

    def _writer_counts(self, tid: int) -> tuple[int, dict[int, int]] | None:
        """The counts a stream ring's writer kept in its header, exact up to its stream
        position counted_to, and those of the words after it; None without such a
        position (0: another writer, or one that died changing its counts)."""
        if not self.ring_path(tid).exists():
            return None
        with Ring.open(self.ring_path(tid)) as ring:
            counted_to = ring._get("counted_to")
            slots = bool(ring.table_size)
            if counted_to == 0 or ring.mode != Mode.STREAM:
                return None
            records = ring._get("counted_records")
            gaps = {
                int(reason): n
                for reason in GapReason
                if (n := ring._get(f"counted_gap_{reason.name.lower()}"))
            }
            rest, pos = RingReader(ring).read_words()
            after = self._words_after(tid, counted_to, rest, pos)
        if after is None:
            return None
        n, found = count_records(after, slots=slots)
        for reason, k in found.items():
            gaps[reason] = gaps.get(reason, 0) + k
        return records + n, gaps

    def _words_after(self, tid: int, at: int, rest: np.ndarray, pos: int) -> np.ndarray | None:
        """The thread's words from stream position `at` on, given the ring's `rest` (from
        position `pos`), reading only the end of its stream file; None if `at` is not
        among them."""
        if at >= pos:
            return rest[min((at - pos) // 8, rest.size) :]
        packed = self.stream_path(tid, packed=True)
        if packed.exists():
            total = packed_size(packed)
            wanted = total - at // 8
            if wanted <= 0:
                return None
            tail, total = packed_tail(packed, max(wanted, total - pos // 8))
            rest = self._after_drained(tid, tail, rest, pos, total)
            return np.concatenate([tail[tail.size - wanted :], rest])
        drained = self._drained(tid)  # raw
        if drained is None or drained.size <= at // 8:
            return None
        rest = self._after_drained(tid, drained, rest, pos)
        return np.concatenate([drained[at // 8 :], rest])

    def _counted_parts(self, tid: int) -> Iterator[tuple[np.ndarray, bool]]:
        """`words(tid)` as stored (block slots not expanded), in pieces of whole records,
        each with whether it holds slots."""
        for piece, ring in self._stored_pieces(tid):
            yield piece, ring is not None and bool(ring.table_size)

    def word_pieces(self, tid: int, most: int | None = None) -> Iterator[np.ndarray]:
        """`words(tid)` a piece at a time, oldest first, each whole records with its block
        slots expanded: the memory of a piece (a stream file's, at most `most` words),
        not of the stream.  The next piece is read (decompressed, expanded) in a thread
        of its own while the caller decodes this one: both release the GIL."""
        return _read_ahead(self._expanded_pieces(tid, most))

    def _expanded_pieces(self, tid: int, most: int | None) -> Iterator[np.ndarray]:
        for piece, ring in self._stored_pieces(tid):
            words = ring.expand(piece) if ring is not None else np.asarray(piece)
            if most is None or words.size <= most:
                yield words
                continue
            at = 0
            while at < words.size:
                end = _record_boundary(words, at + most)
                yield words[at:end]
                at = end

    def _stored_pieces(self, tid: int) -> Iterator[tuple[np.ndarray, Ring | None]]:
        """`words(tid)` as stored (block slots not expanded), in pieces of whole records,
        each with the ring that expands them (None: a snapshot, whose words are)."""
        packed = self.stream_path(tid, packed=True)
        raw = self.stream_path(tid)
        if not self.ring_path(tid).exists():  # a snapshot: the words alone
            drained = self._drained(tid)
            yield (np.zeros(0, dtype="<u8") if drained is None else drained), None
            return
        with Ring.open(self.ring_path(tid)) as ring:
            rest, pos = RingReader(ring).read_words()
            if packed.exists():
                total = packed_size(packed)
                tail, _ = packed_tail(packed, max(0, total - pos // 8))
                rest = self._after_drained(tid, tail, rest, pos, total) if total else rest
                yield from ((piece, ring) for piece in packed_pieces(packed))
            elif raw.exists() and raw.stat().st_size >= 8:
                drained = self._drained(tid)
                assert drained is not None
                rest = self._after_drained(tid, drained, rest, pos)
                # slices of whole chunks (the file starts at stream position 0), which
                # records never straddle
                step = _COUNT_SLICE // 8
                for at in range(0, drained.size, step):
                    yield np.asarray(drained[at : at + step]), ring
            yield rest, ring

    @contextlib.contextmanager
    def _stream_parts(self, tid: int) -> Iterator[tuple[Ring | None, list[np.ndarray], int]]:
        """The thread's ring (open while inside; None for a snapshot, whose words are all
        it has), the parts of its stream as stored (block slots not expanded), and the
        stream position of the first word."""
        drained = self._drained(tid)
        if not self.ring_path(tid).exists():  # a snapshot: the words alone
            yield None, [np.zeros(0, dtype="<u8") if drained is None else drained], 0
            return
        with Ring.open(self.ring_path(tid)) as ring:
            rest, pos = RingReader(ring).read_words()
            parts: list[np.ndarray] = []
            if drained is not None and drained.size:
                rest = self._after_drained(tid, drained, rest, pos)
                parts.append(drained)
                pos = 0
            if rest.size or not parts:
                parts.append(rest)
            yield ring, parts, pos


def _read_ahead(pieces: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    """`pieces`, each read by a thread of its own while the caller has the one before."""
    ahead: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)
    stop = threading.Event()

    def read() -> None:
        try:
            for piece in pieces:
                ahead.put(("piece", piece))
                if stop.is_set():
                    return
            ahead.put(("done", None))
        except BaseException as e:  # handed to the caller, raised there
            ahead.put(("error", e))
        finally:
            pieces.close()  # type: ignore[attr-defined]

    reader = threading.Thread(target=read, name="branchtrace-read-ahead", daemon=True)
    reader.start()
    try:
        while True:
            what, value = ahead.get()
            if what == "done":
                return
            if what == "error":
                raise value
            yield value
    finally:
        stop.set()
        while reader.is_alive():  # unblock a put() the caller will never take
            with contextlib.suppress(queue.Empty):
                ahead.get(timeout=0.01)
        reader.join()


def _record_boundary(words: np.ndarray, at: int) -> int:
    """The first record boundary of `words` (whole records) at or after index `at`: past
    the payload of any header before it that reaches it."""
    while at < words.size:
        near = words[max(at - MAX_RING_PAYLOAD, 0) : at]
        headers = np.flatnonzero(near >> np.uint64(63))
        if headers.size == 0:
            return at
        h = int(headers[-1])
        end = at - near.size + h + 1 + int((near[h] >> np.uint64(LEN_SHIFT)) & np.uint64(LEN_MASK))
        if end <= at:
            return at
        at = end
    return words.size


def _is_ours(name: str) -> bool:
    return (
        name in _OURS
        or name.startswith(".")
        or (name.startswith("T") and name.endswith((".bts", ".stream", PACKED, ".sched.npy")))
    )


#: bytes of a raw stream file counted at a time (record_counts): a multiple of the chunk
_COUNT_SLICE = 64 << 20

#: bytes packed and counted at a time: the drain of a 32 MiB ring took 25% less CPU in
#: 1 MiB slices than whole (fib(40), 5.3 GB of 8-byte block words: 1.44 -> 1.08-1.22 s)
DRAIN_SLICE = 1 << 20


def drain_to_file(
    reader: RingReader,
    fd: int,
    *,
    final: bool = False,
    live: bool = False,
    packed: bool = False,
    count: bool = True,
) -> tuple[int, int, dict[int, int]]:
    """Append what the consumer `reader` can take from its ring to `fd`, straight from the
    shared mapping, and release it to the writer.  Returns (bytes, records, GAP records by
    reason) moved.

    `final`: the writer is gone; also take the records it wrote past data_head.
    `live`: with `final`, its thread is not: it runs on without its agent (recovered_head).
    `packed`: `fd` is a packed stream file (packed.py), not raw words.
    `count`: count the records (else 0 and {}: a writer that counts what it writes).

    A write that fails (a full disk) raises OSError with the file cut back to where it was
    and the ring's records not released: the file and the ring still hold the stream whole.
    """
    ring = reader.ring
    head = recovered_head(ring, live=live) if final else ring.head
    if head > ring.head:  # the writer is dead: publish what we recovered, for later readers
        ring._set("data_head", head)
    tail = ring.tail
    if head <= tail:
        return 0, 0, {}
    mask = ring.data_size - 1
    start, end = tail & mask, head & mask
    words = ring._data
    records, gaps = 0, dict[int, int]()
    slots = ring.table_size > 0
    size_before = os.fstat(fd).st_size
    with memoryview(ring._mm) as mapping:
        view = mapping[HEADER_SIZE : HEADER_SIZE + ring.data_size]
        pieces = [(start, end)] if end > start else [(start, ring.data_size), (0, end)]
        try:
            for a, b in pieces:
                # a slice at a time, counted while the writer's words are still in the
                # cache; slices end at multiples of DRAIN_SLICE, chunk and so record
                # boundaries
                at = a
                while at < b:
                    to = min(b, (at // DRAIN_SLICE + 1) * DRAIN_SLICE)
                    with view[at:to] as piece:
                        if packed:
                            append_packed(fd, piece)
                        else:
                            write_all(fd, piece)
                    if count:
                        n, g = count_records(words[at // 8 : to // 8], slots=slots)
                        records += n
                        for reason, k in g.items():
                            gaps[reason] = gaps.get(reason, 0) + k
                    at = to
        except OSError:
            os.ftruncate(fd, size_before)
            raise
        finally:
            view.release()
    reader.advance(head)
    return head - tail, records, gaps
