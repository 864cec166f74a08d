"""A C writer process and a Python reader share a ring: stream, wrap after SIGKILL, drop."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchtrace import BusyError, ModeConflictError, RingWriter
from branchtrace.store import (
    Flags,
    Mode,
    RecordType,
    Ring,
    RingReader,
    parse_words,
    recovered_head,
)
from branchtrace.store.format import WriterState, block_word

U64 = np.uint64


def expected_types(seq: np.ndarray, esc: int = 0, probe: int = 0) -> np.ndarray:
    """What ring_writer.c writes as record number `seq`."""
    t = np.full(seq.size, RecordType.BLOCK, dtype=np.uint8)
    if probe:
        t[seq % U64(probe) == 0] = RecordType.PROBE_HIT
    if esc:
        t[seq % U64(esc) == 0] = RecordType.BRANCH
    return t


def consume(ring: Ring, on_batch: Callable[[np.ndarray, np.ndarray, int], None]) -> None:
    """Drain `ring` as its consumer until the writer closes it."""
    with RingReader(ring, consume=True) as reader:
        while True:
            closed = ring.writer_state == WriterState.CLOSED
            words, pos = reader.read_words()
            if words.size:
                on_batch(parse_words(words, pos), words, pos)
                reader.advance(pos + words.size * 8)
            elif closed:
                return
            else:
                reader.wait(ring.head, 0.05)


def test_stream_moves_100m_records_between_processes_with_zero_loss(shm_dir, ring_writer):
    n, esc, probe = 100_000_007, 997, 100_003
    ring = Ring.create(shm_dir / "s.bts", 16 << 20, Mode.STREAM, Flags.TRACE | Flags.SIGNAL)
    writer = subprocess.Popen(
        [ring_writer, ring.path, str(n), "-e", str(esc), "-p", str(probe)],
        stdout=subprocess.PIPE,
        text=True,
    )
    state = {"next": 1}

    def check(recs: np.ndarray, words: np.ndarray, pos: int) -> None:
        seq = np.arange(state["next"], state["next"] + recs.size, dtype=U64)
        assert np.array_equal(recs["a"], seq), "records missing, duplicated or reordered"
        assert np.array_equal(recs["type"], expected_types(seq, esc, probe))
        blocks = recs["type"] == RecordType.BLOCK
        assert np.array_equal(recs["b"][blocks], seq[blocks] + (seq[blocks] & U64(0xFFFF)))
        assert np.array_equal(recs["b"][~blocks], seq[~blocks])
        state["next"] += recs.size

    consume(ring, check)
    out, _ = writer.communicate(timeout=60)
    assert writer.returncode == 0
    assert out.split() == ["written", str(n), "lost", "0"]
    assert state["next"] - 1 == n
    assert ring.lost_records == 0
    assert ring.header()["writer_waits"] > 0, "the ring never filled: backpressure untested"


def _kill_midway(ring_writer: Path, path: Path, delay: float) -> None:
    proc = subprocess.Popen(
        [ring_writer, path, "0", "-l", "-p", "5", "-r"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()


@pytest.mark.parametrize("delay", [0.0, 0.001, 0.003, 0.007, 0.013, 0.029, 0.051])
def test_wrap_late_reader_after_writer_sigkilled_mid_write(shm_dir, ring_writer, delay):
    path = shm_dir / "w.bts"
    Ring.create(path, 64 << 10, Mode.WRAP, Flags.TRACE).close()
    _kill_midway(ring_writer, path, delay)

    with Ring.open(path) as ring:
        assert not ring.writer_alive() and ring.writer_state == WriterState.ACTIVE
        head = recovered_head(ring)
        assert head >= ring.head  # the lazy writer left records past data_head
        words, pos = RingReader(ring).read_words()
        recs = parse_words(words, pos)
    assert recs.size > 0 and words.size * 8 >= (64 << 10) * 7 // 8 - 504
    seq = recs["a"]
    assert np.array_equal(seq, np.arange(seq[0], seq[0] + seq.size, dtype=U64))
    assert np.array_equal(recs["type"], expected_types(seq, probe=5))
    # every 63-word PROBE_HIT returned is whole: all 62 payload words are its number
    at = ((recs["pos"][recs["type"] == RecordType.PROBE_HIT] - U64(pos)) // U64(8)).astype(int)
    payload = words[at[:, None] + np.arange(1, 63)]
    assert (payload == seq[recs["type"] == RecordType.PROBE_HIT][:, None]).all()


def test_a_writer_alive_but_gone_quiet_gives_its_unpublished_records_only_when_asked(
    shm_dir, ring_writer
):
    """A traced process that runs on after Frida dropped its agent keeps the ring's writer
    lock: its records past data_head are taken only with `live`, and are whole."""
    path = shm_dir / "q.bts"
    Ring.create(path, 64 << 10, Mode.WRAP, Flags.TRACE).close()
    proc = subprocess.Popen(
        [ring_writer, path, "0", "-l", "-p", "5", "-r"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    unpublished = 0
    try:
        with Ring.open(path) as ring:
            for _ in range(8):
                time.sleep(0.005)
                proc.send_signal(signal.SIGSTOP)
                time.sleep(0.02)  # the stop is delivered
                assert ring.writer_alive()
                head = ring.head
                assert recovered_head(ring) == head
                unpublished += recovered_head(ring, live=True) - head
                words, pos = RingReader(ring).read_words(live=True)
                assert pos + 8 * words.size == recovered_head(ring, live=True) >= head
                recs = parse_words(words, pos)
                seq = recs["a"]
                assert np.array_equal(seq, np.arange(seq[0], seq[0] + seq.size, dtype=U64))
                assert np.array_equal(recs["type"], expected_types(seq, probe=5))
                proc.send_signal(signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert unpublished > 0, "the lazy writer had published everything: nothing recovered"


def test_torn_record_past_head_is_never_returned(shm_dir):
    path = shm_dir / "t.bts"
    ring = Ring.create(path, 8192, Mode.WRAP)
    w = RingWriter(ring)
    for i in range(1, 11):
        w.write(RecordType.BLOCK, 0, i)
    # Simulate a lazy inline writer killed mid-record: two whole BLOCK words past the
    # published head, then a 3-word BRANCH whose payload landed but whose header did not.
    at = ring.head // 8
    ring._data[at : at + 2] = [11, 12]
    ring._data[at + 3 : at + 5] = [0x1234, 0x5678]
    w.ring._set("writer_state", WriterState.ACTIVE)
    os.close(os.dup(ring.fd))
    from branchtrace.store.ring import _WRITER_LOCK_BYTE, _ofd_unlock

    _ofd_unlock(ring.fd, _WRITER_LOCK_BYTE)  # the writer "dies" without closing
    with Ring.open(path) as late:
        recs = RingReader(late).read()
    assert recs["a"].tolist() == list(range(1, 13))


@settings(max_examples=60, deadline=None)
@given(
    laps=st.integers(0, 3),
    filled=st.integers(0, 1023),
    new=st.integers(0, 1023),
    far=st.booleans(),
)
def test_inline_pointer_ends_recovery_where_the_writer_stopped(laps, filled, new, far):
    """An inline writer that does not zero its chunks: the words past its pointer are stale
    records of an earlier lap, valid-looking, and must never be recovered."""
    from branchtrace.store.ring import _WRITER_LOCK_BYTE, _ofd_unlock

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        ring = Ring.create(Path(d) / "i.bts", 64 << 10, Mode.WRAP, chunk_size=8192)
        w = RingWriter(ring)
        for i in range(1, laps * 8192 + filled + 1):  # earlier laps, then part of a chunk
            w.write(RecordType.BLOCK, 0, i)
        head, claim = ring.head, ring._get("claim_end")
        at = (head & (ring.data_size - 1)) // 8
        room = (claim - head) // 8
        new = min(new, room)
        stale = np.arange(1, room + 1, dtype=U64) + U64(0x5000_0000)
        ring._data[at : at + room] = stale  # what an unzeroed chunk holds
        ring._data[at : at + new] = np.arange(1, new + 1, dtype=U64) + U64(0x7000_0000)
        base = 0x4000_0000
        ring._set("inline_base", base)
        # the pointer after the new words, or (far) at the writer's scratch chunk
        ring._set("inline_ptr", 0x1000 if far else base + (head & (ring.data_size - 1)) + 8 * new)
        _ofd_unlock(ring.fd, _WRITER_LOCK_BYTE)  # the writer dies without publishing
        with Ring.open(ring.path) as late:
            assert recovered_head(late) == head + (0 if far else 8 * new)
            recs = RingReader(late).read()
        ring.close()
    tail = recs["a"][recs["a"] >= 0x5000_0000]
    assert tail.tolist() == ([] if far else list(range(0x7000_0001, 0x7000_0001 + new)))


@settings(max_examples=60, deadline=None)
@given(
    laps=st.integers(0, 3),
    filled=st.integers(0, 1000),
    new=st.integers(0, 2045),
    far=st.booleans(),
)
def test_a_block_id_ring_recovers_exactly_the_slots_before_the_pointer(laps, filled, new, far):
    """The stalker agent's layout: 4-byte block ids, each stored as 8 bytes at its pointer
    minus 4 (the id and a zero for the slot after it), over an earlier lap's stale ids."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        ring = Ring.create(
            Path(d) / "s.bts", 64 << 10, Mode.WRAP, chunk_size=8192, table_entries=64
        )
        table = ring._table
        table[1:] = [block_word(0x400000 + 16 * i) for i in range(1, 64)]
        ring._set("table_count", 64)
        base, chunk, size = 0x4000_0000, 8192, 64 << 10

        def store(pos: int, ident: int) -> None:  # mov qword [wp-4], id
            at = (pos & (size - 1)) // 4
            view = ring._data.view("<u4")
            view[at], view[at + 1] = ident, 0

        for lap in range(laps):  # earlier laps: the whole ring, ids 1..63 over and over
            for p in range(size // 4 - 1):
                store(lap * size + 4 * p, 1 + p % 63)
        # this lap: `filled` ids published (data_head), then `new` past it, in one chunk
        pos = laps * size + 2 * chunk
        claim = pos + chunk
        head = pos + 8 * (filled // 2)
        new = min(new, chunk // 4 - 1 - filled // 2 * 2)  # a chunk's last slot stays empty
        for i in range(filled // 2 * 2 + new):
            store(pos + 4 * i, 1 + (i * 7) % 63)
        ring._set("data_tail", max(0, claim - size))
        ring._set("data_head", head)
        ring._set("claim_end", claim)
        ring._set("inline_base", base)
        wp = 4 * (filled // 2 * 2 + new) + 4  # the pointer leads its last slot by 4
        ring._set("inline_ptr", 0x1000 if far else base + (pos & (size - 1)) + wp)
        ring._set("writer_state", WriterState.ACTIVE)
        with Ring.open(ring.path) as late:
            end = head if far else pos + -(-(wp - 4) // 8) * 8
            assert recovered_head(late) == end
            words, at = RingReader(late).read_words()
            blocks = late.expand(words[(head - at) // 8 :])
        ring.close()
    ids = [1 + (i * 7) % 63 for i in range(filled // 2 * 2, filled // 2 * 2 + new)]
    assert blocks.tolist() == ([] if far else [block_word(0x400000 + 16 * i) for i in ids])


def test_drop_mode_counts_every_lost_record_exactly(shm_dir, ring_writer):
    n = 3_000_017
    ring = Ring.create(shm_dir / "d.bts", 64 << 10, Mode.DROP, Flags.TRACE | Flags.DROP)
    writer = subprocess.Popen(
        [ring_writer, ring.path, str(n), "-e", "101"], stdout=subprocess.PIPE, text=True
    )
    got: list[np.ndarray] = []

    def slow(recs: np.ndarray, words: np.ndarray, pos: int) -> None:
        got.append(recs.copy())
        time.sleep(0.002)  # slower than the writer: the ring overflows again and again

    consume(ring, slow)
    out, _ = writer.communicate(timeout=60)
    written, lost = int(out.split()[1]), int(out.split()[3])
    recs = np.concatenate(got)
    data = recs[recs["type"] != RecordType.LOST]
    announced = recs[recs["type"] == RecordType.LOST]
    assert lost > 0 and written + lost == n
    assert ring.lost_records == lost
    assert data.size == written
    assert int(announced["a"].sum()) <= lost  # the rest is past the last record
    # each LOST record sits exactly where its count of numbers is missing
    seq = np.concatenate([[0], recs["a"]]).astype(np.int64)
    is_lost = np.concatenate([[False], recs["type"] == RecordType.LOST])
    prev = np.maximum.accumulate(np.where(is_lost, 0, seq))
    for i in np.flatnonzero(is_lost):
        nxt = np.flatnonzero(~is_lost[i:])
        after = seq[i + nxt[0]] if nxt.size else n + 1
        assert after - prev[i - 1] - 1 == seq[i]
    tail_gap = n - int(data["a"][-1])
    assert int(announced["a"].sum()) + tail_gap == lost
    assert np.all(np.diff(data["a"].astype(np.int64)) > 0)


def test_stream_writer_signals_a_stalled_consumer(shm_dir, ring_writer):
    hits = []
    old = signal.signal(signal.SIGIO, lambda *a: hits.append(1))
    try:
        ring = Ring.create(
            shm_dir / "n.bts",
            8192,
            Mode.STREAM,
            Flags.TRACE | Flags.SIGNAL,
            notify_signal=signal.SIGIO,
        )
        reader = RingReader(ring, consume=True)
        writer = subprocess.Popen([ring_writer, ring.path, "5000"], stdout=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while not hits and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hits, "no SIGIO while the ring was full"
        total = 0
        while writer.poll() is None or ring.head > ring.tail:
            recs = reader.read()
            total += recs.size
            if recs.size:
                reader.advance(int(recs["pos"][-1]) + 8)
            time.sleep(0.001)
        writer.communicate()
        assert total == 5000 and writer.returncode == 0
    finally:
        signal.signal(signal.SIGIO, old)


def test_one_writer_per_ring_and_the_error_names_the_owner(shm_dir, ring_writer):
    ring = Ring.create(shm_dir / "b.bts", 8192, Mode.STREAM, Flags.TRACE | Flags.SIGNAL)
    owner = subprocess.Popen([ring_writer, ring.path, "0"], stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 5
        while ring.writer_pid != owner.pid and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(BusyError, match=f"pid {owner.pid}"):
            RingWriter(ring)
    finally:
        owner.kill()
        owner.communicate()
    with RingWriter(ring):  # the lock died with its owner
        pass
    with RingWriter(ring):
        second = subprocess.run([ring_writer, ring.path, "1"], capture_output=True, text=True)
    assert second.returncode == 3 and "busy" in second.stderr


def test_consumer_excludes_wrap_mode_and_other_consumers(shm_dir):
    wrap = Ring.create(shm_dir / "w.bts", 8192, Mode.WRAP)
    with pytest.raises(ModeConflictError, match="wrap mode"):
        RingReader(wrap, consume=True)
    RingReader(wrap).read()  # read-only readers are always welcome
    stream = Ring.create(shm_dir / "s.bts", 8192, Mode.STREAM)
    with RingReader(stream, consume=True), pytest.raises(BusyError, match="consumer"):
        RingReader(Ring.open(stream.path, writable=True), consume=True)
