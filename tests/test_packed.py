"""Packed (LZ4) stream files: what stream mode drains, read back word for word; and the
block slots of rings with a block table, expanded and counted."""

from __future__ import annotations

import os

import lz4.block
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchtrace.errors import StoreError
from branchtrace.store import RecordType
from branchtrace.store.format import BLOCK_ADDR_MASK, block_word, escape, payload_word
from branchtrace.store.packed import (
    DICT,
    DICTIONARY_PIECE,
    PIECE,
    append_packed,
    packed_tail,
    read_packed,
)
from branchtrace.store.records import count_records, expand_slots, parse_words

# drains of words: some runs repeat (as loops do), some do not
drains = st.lists(
    st.lists(st.integers(0, 2**64 - 1), max_size=300).map(lambda ws: np.array(ws, dtype="<u8")),
    max_size=8,
)


def write(path, pieces: list[np.ndarray]) -> list[int]:
    """Append each drain as a piece; the file size after each."""
    ends = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
    try:
        for words in pieces:
            append_packed(fd, memoryview(words).cast("B"))
            ends.append(os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return ends


@settings(max_examples=60, deadline=None)
@given(pieces=drains, repeat=st.integers(1, 2000))
def test_pieces_read_back_as_the_words_drained(tmp_path_factory, pieces, repeat):
    pieces = [np.tile(p, repeat if i % 2 else 1) for i, p in enumerate(pieces)]
    path = tmp_path_factory.mktemp("p") / "T1.stream.lz4"
    write(path, pieces)
    expected = np.concatenate(pieces) if pieces else np.zeros(0, dtype="<u8")
    assert np.array_equal(read_packed(path), expected)


@settings(max_examples=60, deadline=None)
@given(pieces=drains, want=st.integers(0, 700), cut=st.integers(0, 40))
def test_the_tail_of_a_packed_stream_is_its_last_pieces(tmp_path_factory, pieces, want, cut):
    # how a thread ended is read from the tail alone: the last pieces that hold `want`
    # words, decompressed, and nothing before them; a last piece cut short is not read
    path = tmp_path_factory.mktemp("p") / "T1.stream.lz4"
    ends = write(path, pieces)
    whole = read_packed(path)
    if ends and cut:
        os.truncate(path, ends[-1] - min(cut, ends[-1] - (ends[-2] if len(ends) > 1 else 0)))
        whole = read_packed(path)
    tail, total = packed_tail(path, want)
    assert total == whole.size
    assert np.array_equal(tail, whole[whole.size - tail.size :])
    assert tail.size >= min(want, whole.size)
    starts = set(np.cumsum([0, *(raw // 8 for raw in read_pieces(path))]).tolist())
    assert whole.size - tail.size in starts  # from a piece's start: whole records


def read_pieces(path) -> list[int]:
    """The raw sizes of the whole pieces in a packed stream file."""
    blob, out, off = path.read_bytes(), [], 0
    while off + PIECE.size <= len(blob):
        raw, packed = PIECE.unpack_from(blob, off)
        if off + PIECE.size + packed > len(blob):
            break
        out.append(raw)
        off += PIECE.size + packed
    return out


def dictionary_piece(words: np.ndarray) -> bytes:
    """A piece as the recorders before block ids wrote them: the distinct words, then LZ4
    of an index into them per word."""
    distinct, index = np.unique(words, return_inverse=True)
    ids = index.astype("<u1" if distinct.size <= 256 else "<u2")
    body = DICT.pack(distinct.size, ids.itemsize) + distinct.astype("<u8").tobytes()
    body += lz4.block.compress(ids.tobytes(), mode="fast", store_size=False)
    return PIECE.pack(words.size * 8 | DICTIONARY_PIECE, len(body)) + body


@pytest.mark.parametrize("distinct", [1, 256, 257, 65536])
def test_dictionary_pieces_of_earlier_recordings_still_read(tmp_path, distinct):
    rng = np.random.default_rng(distinct)
    words = rng.permutation(np.tile(rng.integers(0, 2**64, distinct, dtype="<u8"), 3))
    plain = np.arange(7, dtype="<u8")
    path = tmp_path / "T1.stream.lz4"
    write(path, [plain])
    with open(path, "ab") as f:
        f.write(dictionary_piece(words))
    assert np.array_equal(read_packed(path), np.concatenate([plain, words]))


@settings(max_examples=60, deadline=None)
@given(pieces=drains, cut=st.floats(0, 1))
def test_a_file_cut_short_holds_exactly_its_whole_pieces(tmp_path_factory, pieces, cut):
    path = tmp_path_factory.mktemp("p") / "T1.stream.lz4"
    ends = write(path, pieces)
    size = int(path.stat().st_size * cut)
    os.truncate(path, size)
    whole = [p for p, end in zip(pieces, ends, strict=True) if end <= size]
    expected = np.concatenate(whole) if whole else np.zeros(0, dtype="<u8")
    assert np.array_equal(read_packed(path), expected)


PAD = escape(RecordType.PAD, 0)
# what an inline writer with a block table stores: block ids, and escape records whose
# payload may hold anything below bit 63 (a TIME stamp's high half is not a block id)
slot_records = st.lists(
    st.one_of(
        st.integers(1, 30).map(lambda i: ("id", i)),
        st.integers(0, 3).map(lambda r: ("words", [escape(RecordType.GAP, 0, r)])),
        st.integers(0, 2**63 - 1).map(
            lambda t: ("words", [escape(RecordType.TIME, 1), payload_word(t)])
        ),
        st.just(("words", [PAD])),
        # a block compiled once the table was full: a BLOCK_FAR record, read as a BLOCK
        st.integers(1, 30).map(lambda i: ("far", i)),
    ),
    max_size=300,
)


def slot_words(records) -> np.ndarray:
    """`records` laid out as stalker_agent.c lays them: two ids to a word, low slot first;
    an escape record after an odd number of ids leaves that word's high slot empty."""
    words: list[int] = []
    low: int | None = None
    for kind, value in records:
        if kind == "id":
            if low is None:
                low = value
            else:
                words.append(low | value << 32)
                low = None
        else:
            if low is not None:
                words.append(low)
                low = None
            if kind == "far":
                start, off = int(TABLE[value]) & BLOCK_ADDR_MASK, int(TABLE[value]) >> 47
                words += [escape(RecordType.BLOCK_FAR, 1, off), payload_word(start)]
            else:
                words += value
    if low is not None:
        words.append(low)
    return np.array(words, dtype="<u8")


TABLE = np.array([0] + [block_word(0x400000 + 16 * i, i % 5) for i in range(1, 31)], "<u8")


@settings(max_examples=200, deadline=None)
@given(records=slot_records)
def test_slots_expand_to_their_blocks_and_are_counted_the_same(records):
    words = slot_words(records)
    expanded = expand_slots(words, TABLE)
    expected = [w for kind, v in records for w in ([TABLE[v]] if kind != "words" else v)]
    assert expanded.tolist() == [int(w) for w in expected]
    parsed = parse_words(expanded)
    assert parsed.size == sum(v != [PAD] for _, v in records)
    assert count_records(words, slots=True) == count_records(expanded)
    assert count_records(words, slots=True)[0] == parsed.size


def test_a_slot_outside_the_table_is_one_clear_error():
    with pytest.raises(StoreError, match="block table"):
        expand_slots(np.array([1 | 31 << 32], "<u8"), TABLE)
    with pytest.raises(StoreError, match="block table"):
        expand_slots(np.array([5 << 32], "<u8"), TABLE)  # an empty low slot


def test_a_corrupt_piece_is_one_clear_error(tmp_path):
    path = tmp_path / "T1.stream.lz4"
    write(path, [np.arange(1000, dtype="<u8")])
    blob = bytearray(path.read_bytes())
    blob[PIECE.size : PIECE.size + 8] = b"\xff" * 8
    path.write_bytes(bytes(blob))
    with pytest.raises(StoreError, match="corrupt"):
        read_packed(path)
    path.write_bytes(PIECE.pack(12, 4) + b"abcd")  # not a whole number of words
    with pytest.raises(StoreError, match="not a packed stream"):
        read_packed(path)
