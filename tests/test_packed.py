"""Packed (LZ4) stream files: what stream mode drains, read back word for word."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchtrace.errors import StoreError
from branchtrace.store.packed import PIECE, append_packed, read_packed

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
@given(pieces=drains, cut=st.floats(0, 1))
def test_a_file_cut_short_holds_exactly_its_whole_pieces(tmp_path_factory, pieces, cut):
    path = tmp_path_factory.mktemp("p") / "T1.stream.lz4"
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
