"""The seed's BTS API (TaskTrace), the record encoding and bad store files."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchtrace import (
    CorruptStoreError,
    Flags,
    InvalidArgumentError,
    Mode,
    NoBufferError,
    NotSupportedError,
    OverCapError,
    RingWriter,
    StoreError,
    TaskTrace,
)
from branchtrace.store import (
    HEADER_DTYPE,
    BranchKind,
    MemoryCap,
    RecordType,
    Ring,
    RingReader,
    parse_meta,
    parse_size,
    parse_words,
    record_words,
    tracedir,
)
from branchtrace.store.format import (
    HEADER_SIZE,
    GapReason,
    block_word,
    c_definitions,
    escape,
    meta_entry,
    payload_word,
)
from branchtrace.store.tracedir import (
    GENERATION,
    TraceDir,
    _read_ahead,
    drain_to_file,
    parse_thread_label,
    thread_id,
    thread_key,
    thread_label,
)


@pytest.fixture
def task(shm_dir):
    t = TaskTrace(shm_dir / "task.bts", tid=4242, cap=MemoryCap(1 << 24))
    yield t
    t.close()


def fill(task: TaskTrace, n: int, first: int = 1) -> None:
    with RingWriter(task.ring) as w:
        for i in range(first, first + n):
            w.write(RecordType.BLOCK, 0, i)


def test_no_buffer_until_config(task):
    for call in (task.status, task.size, task.clear, task.drain, lambda: task.get(0)):
        with pytest.raises(NoBufferError):
            call()


def test_config_rounds_size_down_to_a_power_of_two_in_bytes(task):
    task.config(100_000, Flags.TRACE)
    assert task.status().size_bytes == 65536
    assert task.status().mode == Mode.WRAP
    assert task.ring.tid == 4242


@pytest.mark.parametrize("size", [-1, 1, 4095])
def test_config_rejects_bad_sizes(task, size):
    with pytest.raises(InvalidArgumentError):
        task.config(size, Flags.TRACE)


def test_config_rejects_unknown_and_unsupported_flags(shm_dir):
    t = TaskTrace(shm_dir / "x.bts", supported=Flags.TRACE | Flags.SIGNAL, cap=MemoryCap(1 << 24))
    with pytest.raises(InvalidArgumentError):
        t.config(8192, Flags(1 << 10))
    with pytest.raises(NotSupportedError, match="SCHED"):
        t.config(8192, Flags.TRACE | Flags.SCHED)


def test_same_size_keeps_records_and_changes_mode_in_place(task):
    task.config(8192, Flags.TRACE)
    fill(task, 10)
    task.config(8192, Flags.TRACE | Flags.SIGNAL)
    assert task.status().mode == Mode.STREAM and task.size() == 10
    task.config(16384, Flags.TRACE)  # a new size: a new, empty buffer
    assert task.size() == 0 and task.status().size_bytes == 16384


def test_size_zero_frees_the_buffer(task):
    task.config(8192)
    task.config(0)
    assert not task.path.exists()
    with pytest.raises(NoBufferError):
        task.size()


def test_memory_cap_refuses_or_with_cut_size_clamps(shm_dir):
    cap = MemoryCap(1 << 20)
    a = TaskTrace(shm_dir / "a.bts", cap=cap)
    b = TaskTrace(shm_dir / "b.bts", cap=cap)
    a.config(512 << 10)
    with pytest.raises(OverCapError, match="cap"):
        b.config(1 << 20)
    b.config(1 << 20, Flags.TRACE | Flags.CUT_SIZE)
    assert b.status().size_bytes == 512 << 10
    assert cap.used == 1 << 20
    a.config(0)
    assert cap.used == 512 << 10
    with pytest.raises(OverCapError):
        TaskTrace(shm_dir / "c.bts", cap=MemoryCap(4000)).config(1 << 20, Flags.CUT_SIZE)


def test_no_record_count_limit_beyond_memory(task):
    task.config(1 << 24, Flags.TRACE | Flags.SIGNAL)  # 16 MiB: two million 8-byte records
    with RingWriter(task.ring) as w:
        assert w.write_blocks(np.arange(1, 2_000_001, dtype=np.uint64)) == 2_000_000
    assert task.size() == 2_000_000


def test_get_zero_is_newest_and_bad_indices_fail(task):
    task.config(8192)
    fill(task, 5)
    assert [int(task.get(i)["a"]) for i in range(5)] == [5, 4, 3, 2, 1]
    for bad in (5, -1):
        with pytest.raises(InvalidArgumentError, match="out of range"):
            task.get(bad)


@pytest.mark.parametrize("flags", [Flags.TRACE, Flags.TRACE | Flags.SIGNAL, Flags.DROP])
def test_drain_returns_oldest_first_then_clears(task, flags):
    task.config(8192, flags)
    fill(task, 7)
    assert task.drain()["a"].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert task.size() == 0
    fill(task, 3, first=8)
    assert task.drain()["a"].tolist() == [8, 9, 10]


def test_clear_in_wrap_mode_leaves_the_writers_tail_alone(task):
    task.config(8192)
    fill(task, 4)
    tail = task.ring.tail
    task.clear()
    assert task.size() == 0 and task.ring.tail == tail


def test_reopening_an_existing_store(shm_dir):
    t = TaskTrace(shm_dir / "r.bts", cap=MemoryCap(1 << 24))
    t.config(8192)
    fill(t, 3)
    t.close()
    again = TaskTrace(shm_dir / "r.bts", cap=MemoryCap(1 << 24))
    assert again.size() == 3 and again.status().size_bytes == 8192


# -- the encoding ---------------------------------------------------------------------------

addresses = st.one_of(
    st.integers(1, (1 << 47) - 1), st.integers(0xFFFF_8000_0000_0000, (1 << 64) - 1)
)
values = st.integers(0, (1 << 62) - 1)
records = st.one_of(
    st.tuples(st.just(RecordType.BLOCK), st.integers(0, 0xFFFF), st.integers(1, (1 << 62) - 1)),
    st.tuples(st.just(RecordType.BRANCH), st.sampled_from(list(BranchKind)), addresses, addresses),
    st.tuples(
        st.sampled_from([RecordType.SWITCH_IN, RecordType.SWITCH_OUT]),
        st.integers(0, 4095),
        values,
        addresses,
    ),
    st.tuples(st.just(RecordType.THREAD_START), st.integers(1, 1 << 22), values),
    st.tuples(
        st.just(RecordType.THREAD_EXIT),
        st.integers(1, 1 << 22),
        values,
        addresses,
        values,
        st.sampled_from([60, 231]),
    ),
    st.tuples(st.just(RecordType.LOST), st.just(0), values),
    st.tuples(st.just(RecordType.TIME), st.just(0), values),
    st.tuples(
        st.just(RecordType.PROBE_HIT),
        st.integers(0, 1 << 20),
        values,
        addresses,
        st.lists(values, max_size=60),
    ),
)


def expected(rec: tuple) -> tuple[int, int, int, int]:
    rtype, arg, *payload = rec
    if rtype == RecordType.BLOCK:
        return (rtype, arg, payload[0], payload[0] + arg)
    return (rtype, arg, *[*payload, 0, 0][:2])


@settings(max_examples=300, deadline=None)
@given(st.lists(records, max_size=50))
def test_encode_parse_roundtrip(recs):
    words, positions, pos = [], [], 1000
    for r in recs:
        rtype, arg, *payload = r
        if rtype == RecordType.PROBE_HIT:
            payload = payload[:2] + payload[2]
        w = record_words(rtype, arg, *payload)
        positions.append(pos)
        pos += 8 * len(w)
        words += w
    parsed = parse_words(np.array(words, dtype=np.uint64), 1000)
    got = [(int(p["type"]), int(p["arg"]), int(p["a"]), int(p["b"])) for p in parsed]
    assert got == [expected(r) for r in recs]
    assert parsed["pos"].tolist() == positions


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(records, st.lists(values, max_size=3) | st.none()), max_size=40))
def test_pad_records_anywhere_are_left_out_and_move_no_other_record(recs_and_pads):
    # a PAD (and its payload, which may hold anything a payload may, zeros too) before any
    # record: the others parse as without it, at their own positions
    words, positions = [], []
    for r, pad in recs_and_pads:
        if pad is not None:
            words += [escape(RecordType.PAD, len(pad), 0), *(payload_word(p) for p in pad)]
        rtype, arg, *payload = r
        if rtype == RecordType.PROBE_HIT:
            payload = payload[:2] + payload[2]
        positions.append(8 * len(words))
        words += record_words(rtype, arg, *payload)
    parsed = parse_words(np.array(words, dtype=np.uint64))
    got = [(int(p["type"]), int(p["arg"]), int(p["a"]), int(p["b"])) for p in parsed]
    assert got == [expected(r) for r, _ in recs_and_pads]
    assert parsed["pos"].tolist() == positions


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, (1 << 64) - 1), max_size=40))
def test_parse_of_garbage_fails_cleanly_or_parses(words):
    try:
        parse_words(np.array(words, dtype=np.uint64), 0)
    except CorruptStoreError as e:
        assert "\n" not in str(e)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                [
                    RecordType.MODULE_LOAD,
                    RecordType.MODULE_UNLOAD,
                    RecordType.THREAD_NAME,
                    RecordType.PROCESS,
                ]
            ),
            st.integers(0, 1 << 40),
            st.integers(0, 1 << 62),
            st.binary(max_size=40),
            st.text(max_size=60),
        ),
        max_size=8,
    )
)
def test_metadata_roundtrip(entries):
    from branchtrace.store.format import META_FIXED_WORDS

    blob = b""
    want = []
    for rtype, pos, t, build_id, text in entries:
        fixed = list(range(7, 7 + META_FIXED_WORDS[rtype]))
        data = text.encode()
        if rtype == RecordType.MODULE_LOAD:
            data = bytes([len(build_id)]) + build_id + data
        blob += meta_entry(rtype, pos, t, fixed, data)
        want.append((rtype, pos, t, tuple(fixed), data))
    got = parse_meta(blob)
    assert [(e.type, e.pos, e.time_ns, e.fixed, e.data) for e in got] == want
    for e, (rtype, *_, build_id, text) in zip(got, entries, strict=True):
        if rtype == RecordType.MODULE_LOAD:
            assert e.build_id == build_id and e.path == text


def test_writer_metadata_survives_wraparound(task):
    task.config(8192)
    with RingWriter(task.ring) as w:
        w.write_meta(RecordType.MODULE_LOAD, [0x400000, 0x2000], b"\x02\xab\xcd/usr/bin/prog")
        w.write_blocks(np.arange(1, 100_000, dtype=np.uint64))  # wraps many times
    (mod,) = RingReader(task.ring).meta()
    assert (mod.type, mod.fixed, mod.path, mod.build_id) == (
        RecordType.MODULE_LOAD,
        (0x400000, 0x2000),
        "/usr/bin/prog",
        b"\xab\xcd",
    )
    assert task.drain()["a"][0] > 90_000


def test_c_definitions_match_the_header_dtype():
    lines = c_definitions().splitlines()
    defs = dict(line.split()[1:3] for line in lines if line.startswith("#define"))
    for name, (dt, off) in HEADER_DTYPE.fields.items():
        assert int(defs[f"BT_OFF_{name.upper()}"]) == off
        assert int(defs[f"BT_SIZE_{name.upper()}"]) == dt.itemsize
    assert int(defs["BT_RECORDTYPE_LOST"]) == RecordType.LOST


def test_parse_size():
    assert parse_size("4096") == 4096
    assert parse_size("16M") == 16 << 20
    assert parse_size("512KiB") == 512 << 10
    assert parse_size("1g") == 1 << 30
    with pytest.raises(InvalidArgumentError):
        parse_size("lots")


# -- files that are not stores ----------------------------------------------------------------


def _store_bytes(shm_dir) -> bytes:
    t = TaskTrace(shm_dir / "good.bts", cap=MemoryCap(1 << 24))
    t.config(8192)
    fill(t, 20)
    t.close()
    return (shm_dir / "good.bts").read_bytes()


def _patch(raw: bytes, field: str, fmt: str, value: int) -> bytes:
    off = HEADER_DTYPE.fields[field][1]
    return raw[:off] + struct.pack(fmt, value) + raw[off + struct.calcsize(fmt) :]


@pytest.mark.parametrize(
    ("name", "mutate", "message"),
    [
        ("empty", lambda raw: b"", "shorter than"),
        ("foreign", lambda raw: b"\x7fELF" + os.urandom(5000), "bad magic"),
        ("text", lambda raw: b"hello\n" * 1000, "bad magic"),
        ("truncated", lambda raw: raw[: HEADER_SIZE + 100], "truncated"),
        ("version", lambda raw: _patch(raw, "version", "<I", 99), "format version 99"),
        ("size", lambda raw: _patch(raw, "data_size", "<Q", 12345), "power of two"),
        ("head", lambda raw: _patch(raw, "data_head", "<Q", 1 << 40), "inconsistent"),
        ("mode", lambda raw: _patch(raw, "mode", "<I", 7), "unknown mode"),
        (
            "records",
            lambda raw: raw[:HEADER_SIZE] + b"\xff" * 8192 + raw[HEADER_SIZE + 8192 :],
            "bad record header",
        ),
    ],
)
def test_bad_files_give_one_line_errors(shm_dir, name, mutate, message):
    bad = shm_dir / f"{name}.bts"
    bad.write_bytes(mutate(_store_bytes(shm_dir)))
    with pytest.raises(CorruptStoreError, match=message) as info:
        ring = Ring.open(bad)
        RingReader(ring).read()
    assert "\n" not in str(info.value)


def test_default_store_lives_in_dev_shm():
    t = TaskTrace(tid=4243, cap=MemoryCap(1 << 24))
    try:
        t.config(8192)
        assert str(t.path).startswith("/dev/shm/") and "4243" in t.path.name
        assert t.path.exists()
    finally:
        t.config(0)
        t.close()
    assert not t.path.exists()


# -- giving unused space back ---------------------------------------------------------------


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from([Mode.WRAP, Mode.STREAM]),
    blocks=st.integers(0, 4000),
    metas=st.integers(0, 30),
    writer_closed=st.booleans(),
)
def test_released_unused_space_reads_the_same(mode, blocks, metas, writer_closed):
    flags = Flags.TRACE | (Flags.SIGNAL if mode == Mode.STREAM else 0)
    data_size, chunk = 16384, 1024
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        path = Path(d) / "r.bts"
        ring = Ring.create(path, data_size, mode, flags, chunk_size=chunk)
        meta_size = int(ring.header()["meta_size"])
        consumer = RingReader(ring, consume=True) if mode == Mode.STREAM else None
        writer_ring = Ring.open(path, writable=True)  # the writer's own descriptor, as the agent
        writer = RingWriter(writer_ring)
        for i in range(metas):
            writer.write_meta(RecordType.THREAD_NAME, [4242], b"thread %d" % i)
        drained = []
        for i in range(1, blocks + 1):
            writer.write(RecordType.BLOCK, 0, i << 4)
            if consumer is not None and i % 500 == 0:
                drained.append(consumer.read_words()[0])
                consumer.advance(ring.head)
        assert ring.release_unused() == 0  # the writer still holds the ring
        if writer_closed:
            writer.close()
        del writer
        writer_ring.close()  # closed, or died: either way its lock is gone
        if consumer is not None:
            drained.append(consumer.read_words()[0])
            consumer.advance(ring.head)
            assert parse_words(np.concatenate(drained), 0).size == blocks
        before = allocated(path)
        words, meta = RingReader(ring).read_words(), RingReader(ring).meta()

        released = ring.release_unused(drained=consumer is not None)

        assert allocated(path) == before - released  # (before a read: tmpfs fills holes read)
        again = RingReader(ring).read_words()
        assert again[1] == words[1] and np.array_equal(again[0], words[0])
        assert RingReader(ring).meta() == meta and len(meta) == metas
        assert os.stat(path).st_size == HEADER_SIZE + data_size + meta_size
        # released: the log's pages past its head, and the data area's pages that never
        # held a record (all of them, once drained)
        log_pages = meta_size // 4096 - -(-ring._get("meta_head") // 4096)
        if consumer is not None:
            data_pages = data_size // 4096
        elif blocks * 8 >= data_size - chunk:  # the writer claimed its last chunk: wrapped
            data_pages = 0
        else:
            data_pages = data_size // 4096 - -(-ring._get("claim_end") // 4096)
        assert released == (log_pages + data_pages) * 4096
        ring.close()


def test_released_block_table_keeps_every_entry_a_block_id_can_name(shm_dir):
    ring = Ring.create(shm_dir / "t.bts", 1 << 16, Mode.WRAP, Flags.TRACE, table_entries=8192)
    entries = np.arange(1, 1001, dtype=np.uint64) << np.uint64(20)
    ring._table[1:1001] = entries  # as the agent: entries, then the count that covers them
    ring._set("table_count", 1001)
    ring._set("writer_state", 1)
    assert ring.writer_state == 1 and not ring.writer_alive()  # its writer died
    before = allocated(ring.path)
    released = ring.release_unused()
    assert np.array_equal(ring._table[1:1001], entries)
    # the table's 16 pages: the first two hold entries 0-1000; the data area never held a
    # record, and the log nothing
    assert released == (14 + 16 + 256) * 4096 == before - allocated(ring.path)
    ring.close()


MODULES_UNTIL_FULL = """
import resource, sys
from pathlib import Path
from branchtrace.store.tracedir import ModuleEvent, TraceDir

trace = TraceDir.create(Path(sys.argv[1]))
trace.write_meta({"pid": 7})
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # as a full disk, past 1000 bytes
for n in range(100):
    try:
        trace.append_module(ModuleEvent("load", n << 12, 4096, "/lib/x%d.so" % n, n, 7))
    except OSError:
        print(n)
        break
"""


def test_module_lines_are_written_whole_or_not_at_all(tmp_path):
    written = subprocess.run(
        [sys.executable, "-c", MODULES_UNTIL_FULL, str(tmp_path / "d")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert 0 < int(written) < 100
    trace = TraceDir.open(tmp_path / "d")
    assert [m.base >> 12 for m in trace.modules()] == list(range(int(written)))


@given(st.integers(1, (1 << 22) - 1), st.integers(0, 1000))
def test_a_thread_key_names_its_id_and_how_many_threads_had_it_before(tid, earlier):
    key = thread_key(tid, earlier)
    assert thread_id(key) == tid and key // GENERATION == earlier
    label = thread_label(key)
    assert label == (str(tid) if earlier == 0 else f"{tid}#{earlier + 1}")
    assert parse_thread_label(label) == key


@pytest.mark.parametrize("text", ["", "x", "12#", "12#0", "12#-1", "#2", "0", "-5", "1#2#3"])
def test_what_is_not_a_thread_label_is_refused(text):
    with pytest.raises(ValueError):
        parse_thread_label(text)


def test_the_threads_of_a_directory_are_their_keys_in_order(tmp_path):
    for name in ["T300#2.bts", "T56.bts", "T300.stream.lz4", "T1000.bts", "T300#2.stream.lz4"]:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "Tnotes.bts").write_bytes(b"")
    assert TraceDir(tmp_path).threads() == [56, 300, 1000, thread_key(300, 1)]


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.integers(1, 3000),
    packed=st.booleans(),
    cut=st.floats(0, 1),
    counted=st.floats(0, 1),
)
def test_a_recorder_killed_in_a_drain_leaves_every_record_readable_once(
    tmp_path_factory, blocks, packed, cut, counted
):
    # drain_to_file appends to the stream file, then releases the words from the ring: a
    # recorder killed in between, or in the append, leaves the file ahead of the ring
    d = TraceDir(tmp_path_factory.mktemp("t"))
    ring = Ring.create(d.ring_path(77), 16384, Mode.STREAM, Flags.TRACE, chunk_size=1024)
    consumer = RingReader(ring, consume=True)
    fd = os.open(d.stream_path(77, packed=packed), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    writer_ring = Ring.open(ring.path, writable=True)
    writer = RingWriter(writer_ring)
    for i in range(1, blocks + 1):
        writer.write(RecordType.BLOCK, 0, i << 4)
        if i % 97 == 0:
            writer.write(RecordType.GAP, GapReason.SIGNAL)
        if i % 500 == 0 and i != blocks:
            drain_to_file(consumer, fd, packed=packed)
    writer.close()
    writer_ring.close()
    released_at, size_before = ring.tail, os.fstat(fd).st_size
    consumer.advance = lambda pos: None  # killed before the release
    drain_to_file(consumer, fd, packed=packed)
    os.ftruncate(fd, size_before + int(cut * (os.fstat(fd).st_size - size_before)))
    os.close(fd)
    assert ring.tail == released_at

    words, pos = d.words(77)

    assert pos == 0
    recs = parse_words(words)
    in_order = recs["a"][recs["type"] == RecordType.BLOCK]
    assert np.array_equal(in_order, np.arange(1, blocks + 1, dtype=np.uint64) << 4)
    # counted without the whole stream in memory: a packed file a piece at a time, a raw
    # one in slices of whole chunks (here one chunk a slice)
    gaps = {GapReason.SIGNAL: blocks // 97} if blocks >= 97 else {}
    with mock.patch.object(tracedir, "_COUNT_SLICE", 1024):
        assert d.record_counts(77) == (recs.size, gaps) == (blocks + blocks // 97, gaps)
    # a writer that kept counts in the header, exact up to a record's position (the
    # stalker engine's agent, killed): only the words after it are counted, from the end
    # of the stream file and the ring
    k = 1 + int(counted * (recs.size - 2))  # position 0 says "not known"
    if k < recs.size:
        ring._set("counted_to", int(recs["pos"][k]))
        ring._set("counted_records", k)
        ring._set("counted_gap_signal", int((recs["type"][:k] == RecordType.GAP).sum()))
        assert d._writer_counts(77) is not None
        assert d.record_counts(77) == (blocks + blocks // 97, gaps)
    ring.close()


def test_a_stream_file_behind_its_ring_is_named_incomplete(tmp_path):
    d = TraceDir(tmp_path)
    ring = Ring.create(d.ring_path(77), 16384, Mode.STREAM, Flags.TRACE, chunk_size=1024)
    consumer = RingReader(ring, consume=True)
    fd = os.open(d.stream_path(77), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    writer = RingWriter(Ring.open(ring.path, writable=True))
    for i in range(1, 1001):
        writer.write(RecordType.BLOCK, 0, i << 4)
        if i % 500 == 0:
            drain_to_file(consumer, fd)
    os.ftruncate(fd, os.fstat(fd).st_size - 8)  # a drained word lost
    os.close(fd)
    with pytest.raises(StoreError, match=r"T77.stream: holds 7992 bytes but the ring continues"):
        d.words(77)
    writer.close()
    ring.close()


def test_a_thread_end_is_the_thread_exit_record_after_which_nothing_ran():
    from branchtrace.analysis.trace import thread_end

    def words(*records: list[int]) -> np.ndarray:
        return np.array([w for r in records for w in r], dtype=np.uint64)

    blocks = [block_word(0x401000 + 16 * i, 4) for i in range(200)]
    exit_group = record_words(RecordType.THREAD_EXIT, 7, 123, 0x7F00_0000_1234, 3, 231)
    execve = record_words(RecordType.THREAD_EXIT, 7, 124, 0x7F00_0000_2000, 0x5555, 59)
    lost = record_words(RecordType.LOST, 0, 9)
    end = thread_end(words(blocks, exit_group, lost))
    assert end is not None and (end.call, end.status) == ("exit_group", 3)
    assert end.address == 0x7F00_0000_1234
    assert end.describe() == "the process ended here: exit_group(3)"
    end = thread_end(words(blocks, execve))
    assert end is not None and (end.call, end.status) == ("execve", None)
    # an exec that failed: the thread ran on, and its end is not there
    assert thread_end(words(blocks, execve, blocks[:3])) is None
    assert thread_end(words(blocks, execve, blocks[:3], exit_group)).call == "exit_group"
    assert thread_end(words(blocks)) is None
    # a negative status, as exit(-1) passes it
    minus = record_words(RecordType.THREAD_EXIT, 7, 1, 0x401000, 0xFFFFFFFF, 60)
    assert thread_end(words(blocks, minus)).status == -1


def _resident(path: Path, offset: int, length: int) -> np.ndarray:
    """Which pages of the file at `path` in [offset, offset + length) are in memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        pages = ctypes.create_string_buffer(length // 4096)
        assert libc.mincore(addr, length, pages) == 0
        libc.munmap(addr, length)
    finally:
        os.close(fd)
    return np.frombuffer(pages.raw, np.uint8) & 1


def test_prefault_reads_in_the_start_of_the_data_area_and_of_the_block_table(tmp_path):
    # a disk file system, where a writer's first write to a page not in memory waits for it
    ring = Ring.create(tmp_path / "t.bts", 16 << 20, Mode.WRAP, Flags.TRACE, table_entries=1 << 16)
    table_offset = ring._get("table_offset")
    first = HEADER_SIZE // 4096 * 4096
    assert not _resident(ring.path, first + 4096, 1 << 20).any()  # fallocate reads nothing in
    ring.prefault(1 << 20, 64 << 10)
    assert _resident(ring.path, 0, HEADER_SIZE + (1 << 20)).all()
    start = table_offset // 4096 * 4096
    assert _resident(ring.path, start, table_offset + (64 << 10) - start).all()
    ring.close()


def test_a_store_that_cannot_be_mapped_for_want_of_descriptors_leaves_no_file(tmp_path):
    # mmap() duplicates the descriptor: with one left, the file is made and the mapping
    # fails; the recorder's spare rings so made stayed in the recording (under --sched)
    script = f"""
import os, resource
from pathlib import Path
from branchtrace.errors import NoMemoryError
from branchtrace.store import Mode, Ring
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
held = []
while True:
    try:
        held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        break
os.close(held.pop())
try:
    Ring.create(Path({str(tmp_path)!r}) / "x.bts", 1 << 16, Mode.STREAM, 0)
except NoMemoryError as e:
    print("refused:", e)
print(sorted(p.name for p in Path({str(tmp_path)!r}).iterdir()))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    refused, listing = out.stdout.splitlines()
    assert refused.startswith("refused: cannot map") and "Too many open files" in refused
    assert listing == "[]"


def test_pieces_read_ahead_come_in_order_and_a_readers_error_reaches_the_caller():
    """word_pieces reads the next piece in a thread while the caller decodes this one:
    the pieces come in order, an error reading one is raised to the caller after those
    before it, and a caller that stops early leaves no reader behind."""

    def failing():
        yield from (np.full(3, i, np.uint64) for i in range(5))
        raise StoreError("T1.stream: the recording is incomplete")

    got = []
    with pytest.raises(StoreError, match="incomplete"):
        for piece in _read_ahead(failing()):
            got.append(int(piece[0]))
    assert got == [0, 1, 2, 3, 4]

    closed = []

    def endless():
        try:
            while True:
                yield np.zeros(1, np.uint64)
        finally:
            closed.append(True)

    pieces = _read_ahead(endless())
    next(pieces)
    pieces.close()
    assert closed == [True]
    assert not [t for t in threading.enumerate() if t.name == "branchtrace-read-ahead"]
