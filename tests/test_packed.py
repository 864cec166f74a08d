"""Packed (LZ4) stream files: what stream mode drains, read back word for word."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchtrace.errors import StoreError
from branchtrace.store import RecordType, packed
from branchtrace.store.format import block_word, escape, payload_word
from branchtrace.store.packed import (
    DICTIONARY_PIECE,
    PIECE,
    append_packed,
    load_dictionary_coder,
    read_packed,
)
from branchtrace.store.records import count_records

load_dictionary_coder()
DICTIONARY_CODER = packed._dict_encode


@contextlib.contextmanager
def coder(kind: str):
    """Pack with the dictionary coder, or plainly (as before the recorder has loaded it)."""
    packed._dict_encode = DICTIONARY_CODER if kind == "dictionary" else None
    try:
        yield
    finally:
        packed._dict_encode = DICTIONARY_CODER


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


@pytest.mark.parametrize("kind", ["dictionary", "plain"])
@settings(max_examples=60, deadline=None)
@given(pieces=drains, repeat=st.integers(1, 2000))
def test_pieces_read_back_as_the_words_drained(tmp_path_factory, kind, pieces, repeat):
    pieces = [np.tile(p, repeat if i % 2 else 1) for i, p in enumerate(pieces)]
    path = tmp_path_factory.mktemp("p") / "T1.stream.lz4"
    with coder(kind):
        write(path, pieces)
    expected = np.concatenate(pieces) if pieces else np.zeros(0, dtype="<u8")
    assert np.array_equal(read_packed(path), expected)


@pytest.mark.parametrize("distinct", [1, 256, 257, 4096, 4097, 65536, 65537])
def test_dictionary_pieces_up_to_65536_distinct_words_and_plain_beyond(tmp_path, distinct):
    rng = np.random.default_rng(distinct)
    words = rng.permutation(np.tile(rng.integers(0, 2**64, distinct, dtype="<u8"), 3))
    path = tmp_path / "T1.stream.lz4"
    write(path, [words])
    raw, _ = PIECE.unpack_from(path.read_bytes(), 0)
    assert bool(raw & DICTIONARY_PIECE) == (distinct <= 65536)
    assert np.array_equal(read_packed(path), words)


@settings(max_examples=100, deadline=None)
@given(
    records=st.lists(
        st.one_of(
            st.integers(1, 40).map(lambda a: [block_word(0x400000 + a)]),
            st.integers(0, 3).map(lambda r: [escape(RecordType.GAP, 0, r)]),
            st.integers(0, 9).map(lambda t: [escape(RecordType.TIME, 1), payload_word(t)]),
            st.just([escape(RecordType.PAD, 0)]),
        ),
        max_size=400,
    )
)
def test_records_are_counted_the_same_from_a_dictionary_piece(tmp_path_factory, records):
    words = np.array([w for r in records for w in r], dtype="<u8")
    fd = os.open(tmp_path_factory.mktemp("p") / "T1.stream.lz4", os.O_WRONLY | os.O_CREAT)
    try:
        census = append_packed(fd, memoryview(words).cast("B"))
    finally:
        os.close(fd)
    direct = count_records(words)
    assert direct[0] == sum(r != [escape(RecordType.PAD, 0)] for r in records)
    counted = [count_records(distinct, times) for distinct, times in census]
    gaps: dict[int, int] = {}
    for _, g in counted:
        for reason, n in g.items():
            gaps[reason] = gaps.get(reason, 0) + n
    assert (sum(n for n, _ in counted), gaps) == direct


@pytest.mark.parametrize("kind", ["dictionary", "plain"])
@settings(max_examples=60, deadline=None)
@given(pieces=drains, cut=st.floats(0, 1))
def test_a_file_cut_short_holds_exactly_its_whole_pieces(tmp_path_factory, kind, pieces, cut):
    path = tmp_path_factory.mktemp("p") / "T1.stream.lz4"
    with coder(kind):
        ends = write(path, pieces)
    size = int(path.stat().st_size * cut)
    os.truncate(path, size)
    whole = [p for p, end in zip(pieces, ends, strict=True) if end <= size]
    expected = np.concatenate(whole) if whole else np.zeros(0, dtype="<u8")
    assert np.array_equal(read_packed(path), expected)


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
