"""Compressed stream files (`T<tid>.stream.lz4`): what stream mode drains, LZ4-compressed.

A stream recording is bound by the bytes it writes, not by the tracing: 100M calls make
1.2 GB of 4-byte block ids, and on a VM every fresh page of page cache costs a fault in the
hypervisor too (measured here: 0.26-1.5 GB/s into tmpfs, 0.27-0.39 GB/s into ext4).  Block
ids repeat as the program loops, so LZ4 shrinks them, like `perf record -z` does with
zstd.  The drain thread compresses (python-lz4 lets go of the GIL meanwhile).

The file is a sequence of pieces, one per drain, each whole records:

    u64 raw_bytes, u64 packed_bytes, then packed_bytes of one LZ4 block (the LZ4 *block*
    format, no frame) that decompresses to raw_bytes of little-endian words.

A piece whose raw_bytes has bit 63 set is dictionary-coded: its packed bytes are u32 n,
u32 width (1 or 2), n distinct words (u64), then one LZ4 block of one `width`-byte index
into those words per word.  Recorders before block ids (store format 3) wrote them, to
keep up with 8-byte block words; they are still read.

A piece cut short (the tool killed while writing it) is not part of the stream: the ring
was advanced only after the write, so those words are still in the ring.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import lz4.block
import numpy as np

from ..errors import StoreError

PIECE = struct.Struct("<QQ")
DICT = struct.Struct("<II")
DICTIONARY_PIECE = 1 << 63  #: flag in raw_bytes
MAX_DISTINCT = 1 << 16
SUFFIX = ".lz4"
#: LZ4 blocks hold at most ~2 GB; a drain larger than this is split
MAX_PIECE = 64 << 20


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until all of `data` is written (a write may take only part of it)."""
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def append_packed(fd: int, data: memoryview) -> None:
    """Append `data` (whole records) to the packed stream open at `fd`."""
    for start in range(0, len(data), MAX_PIECE):
        raw = data[start : start + MAX_PIECE]
        packed = lz4.block.compress(raw, mode="fast", store_size=False)
        write_all(fd, PIECE.pack(len(raw), len(packed)) + packed)


def _pieces(
    path: Path, header_at: Callable[[int], bytes | memoryview], size: int
) -> list[tuple[int, int, int]]:
    """(offset of the packed bytes, raw, packed) of each whole piece of the packed stream
    file of `size` bytes whose piece header at an offset `header_at` gives."""
    pieces: list[tuple[int, int, int]] = []
    off = 0
    while off + PIECE.size <= size:
        raw, packed = PIECE.unpack(header_at(off))
        if (raw & ~DICTIONARY_PIECE) % 8 or raw & ~DICTIONARY_PIECE > MAX_PIECE:
            raise StoreError(f"{path}: not a packed stream (piece at byte {off} is corrupt)")
        if off + PIECE.size + packed > size:
            break  # cut short while being written: its words are still in the ring
        pieces.append((off + PIECE.size, raw, packed))
        off += PIECE.size + packed
    return pieces


def read_packed(path: Path) -> np.ndarray:
    """The words of a packed stream file, oldest first."""
    blob = memoryview(path.read_bytes())  # slices of it are views, not copies
    pieces = _pieces(path, lambda off: blob[off : off + PIECE.size], len(blob))
    return _unpack(path, blob, pieces)


def _file_pieces(path: Path, f: BinaryIO) -> list[tuple[int, int, int]]:
    """_pieces() of the packed stream file open as `f`, its headers read where they are."""

    def header_at(off: int) -> bytes:
        f.seek(off)
        return f.read(PIECE.size)

    return _pieces(path, header_at, os.fstat(f.fileno()).st_size)


def packed_pieces(path: Path) -> Iterator[np.ndarray]:
    """The words of a packed stream file a piece at a time (each whole records), oldest
    first: memory for one piece, not the stream."""
    with path.open("rb") as f:
        for start, raw, packed in _file_pieces(path, f):
            f.seek(start)
            yield _unpack(path, memoryview(f.read(packed)), [(0, raw, packed)], start)


def packed_size(path: Path) -> int:
    """How many words the packed stream file holds, from its pieces' headers."""
    with path.open("rb") as f:
        pieces = _file_pieces(path, f)
    return sum(raw & ~DICTIONARY_PIECE for _, raw, _ in pieces) // 8


def packed_tail(path: Path, words: int) -> tuple[np.ndarray, int]:
    """At least the last `words` words of a packed stream file (all, if it has fewer),
    decompressing only the pieces they are in; and how many words the file holds."""
    with path.open("rb") as f:
        pieces = _file_pieces(path, f)
        total = sum(raw & ~DICTIONARY_PIECE for _, raw, _ in pieces) // 8
        first = len(pieces)
        have = 0
        while first > 0 and have < words:
            first -= 1
            have += (pieces[first][1] & ~DICTIONARY_PIECE) // 8
        if first == len(pieces):
            return np.empty(0, dtype="<u8"), total
        begin, (last, _, last_packed) = pieces[first][0], pieces[-1]
        f.seek(begin)
        blob = memoryview(f.read(last + last_packed - begin))
    tail = [(start - begin, raw, packed) for start, raw, packed in pieces[first:]]
    return _unpack(path, blob, tail, begin), total


def _unpack(
    path: Path, blob: memoryview, pieces: list[tuple[int, int, int]], origin: int = 0
) -> np.ndarray:
    """The words of `pieces`, whose offsets are into `blob`, which is the file from `origin`."""
    words = np.empty(sum(raw & ~DICTIONARY_PIECE for _, raw, _ in pieces) // 8, dtype="<u8")
    at = 0
    for start, raw, packed in pieces:
        try:
            if raw & DICTIONARY_PIECE:
                n = (raw & ~DICTIONARY_PIECE) // 8
                piece = _read_dictionary_piece(blob[start : start + packed], n)
            else:
                chunk = lz4.block.decompress(blob[start : start + packed], uncompressed_size=raw)
                piece = np.frombuffer(chunk, dtype="<u8")
        except (lz4.block.LZ4BlockError, ValueError, IndexError) as e:
            raise StoreError(
                f"{path}: piece at byte {origin + start - PIECE.size} is corrupt ({e})"
            ) from None
        words[at : at + piece.size] = piece
        at += piece.size
    return words


def _read_dictionary_piece(packed: memoryview, n: int) -> np.ndarray:
    distinct, width = DICT.unpack_from(packed, 0)
    if width not in (1, 2) or distinct > MAX_DISTINCT:
        raise ValueError(f"dictionary of {distinct} words, {width}-byte indexes")
    start = DICT.size + 8 * distinct
    dictionary = np.frombuffer(packed[DICT.size : start], dtype="<u8")
    ids = lz4.block.decompress(packed[start:], uncompressed_size=n * width)
    return dictionary[np.frombuffer(ids, dtype="<u1" if width == 1 else "<u2")]


__all__ = ["SUFFIX", "append_packed", "packed_pieces", "packed_size", "read_packed", "write_all"]
