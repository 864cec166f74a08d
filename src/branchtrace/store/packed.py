"""Compressed stream files (`T<tid>.stream.lz4`): what stream mode drains, LZ4-compressed.

A stream recording is bound by the bytes it writes, not by the tracing: 100M calls make
2.4 GB of BLOCK words, and on a VM every fresh page of page cache costs a fault in the
hypervisor too (measured here: 0.26-1.5 GB/s into tmpfs, 0.27-0.39 GB/s into ext4).  Block
words repeat as the program loops, so LZ4 shrinks them (a call loop ~230x at ~18 GB/s, a fib
trace 8x at 2.9 GB/s), like `perf record -z` does with zstd.  The drain thread compresses
(python-lz4 and the numba coder let go of the GIL meanwhile).

The file is a sequence of pieces, one per drain, each whole records:

    u64 raw_bytes, u64 packed_bytes, then packed_bytes of one LZ4 block (the LZ4 *block*
    format, no frame) that decompresses to raw_bytes of little-endian words.

A piece whose raw_bytes has bit 63 set is dictionary-coded: its packed bytes are u32 n,
u32 width (1 or 2), n distinct words (u64), then one LZ4 block of one `width`-byte index
into those words per word.  A drain holds few distinct words (a fib trace: 71 in 4 MiB,
plus one TIME stamp per 8192 words), and LZ4 on the indexes runs ~5x faster and packs ~4x
smaller than on the words (fib: 2.9 -> 8 GB/s of words, 8x -> 38x), which is what keeps the
drain ahead of the traced program on a second core.  Drains with more than 65,536 distinct
words are packed plainly.

A piece cut short (the tool killed while writing it) is not part of the stream: the ring
was advanced only after the write, so those words are still in the ring.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import lz4.block
import numpy as np

from ..errors import StoreError

PIECE = struct.Struct("<QQ")
DICT = struct.Struct("<II")
DICTIONARY_PIECE = 1 << 63  #: flag in raw_bytes
MAX_DISTINCT = 1 << 16
_SMALL_DICTIONARY = 1 << 12
SUFFIX = ".lz4"
#: LZ4 blocks hold at most ~2 GB; a drain larger than this is split
MAX_PIECE = 64 << 20

_dict_encode: Callable[..., int] | None = None


def load_dictionary_coder() -> None:
    """Import (and compile, the first time on a machine) the dictionary coder; until this
    has run, append_packed packs plainly.  Takes ~0.9 s of CPU even when numba's cache
    holds the compiled coder: call it from a background thread."""
    global _dict_encode
    from ._dictcode import dict_encode

    one = np.zeros(1, "<u8")
    dict_encode(one, np.zeros(1, "<u2"), one.copy(), np.zeros(1, np.int64), 2)
    _dict_encode = dict_encode


def _dictionary_piece(raw: memoryview) -> tuple[bytes, np.ndarray, np.ndarray] | None:
    """The packed bytes of a dictionary-coded piece, its distinct words and how often each
    occurs; None if it would not be one."""
    if _dict_encode is None:
        return None
    words = np.frombuffer(raw, dtype="<u8")
    ids = np.empty(words.size, dtype="<u2")
    n = -1
    for most in (_SMALL_DICTIONARY, MAX_DISTINCT):  # small first: its table is cheap to clear
        dictionary = np.empty(min(words.size, most), dtype="<u8")
        times = np.empty(dictionary.size, dtype=np.int64)
        bits = max(4, (2 * dictionary.size - 1).bit_length())
        n = _dict_encode(words, ids, dictionary, times, bits)
        if n >= 0 or dictionary.size == words.size:
            break
    if n < 0:
        return None
    narrow = ids.astype("<u1") if n <= 256 else ids
    packed = lz4.block.compress(narrow.data, mode="fast", store_size=False)
    return (
        DICT.pack(n, narrow.itemsize) + dictionary[:n].tobytes() + packed,
        dictionary[:n],
        times[:n],
    )


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until all of `data` is written (a write may take only part of it)."""
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def append_packed(fd: int, data: memoryview) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Append `data` (whole records) to the packed stream open at `fd`.  Returns its words
    as (words, times) pairs for count_records: the distinct words of each dictionary-coded
    piece with how often each occurs, or a plain piece's words (times None)."""
    census: list[tuple[np.ndarray, np.ndarray | None]] = []
    for start in range(0, len(data), MAX_PIECE):
        raw = data[start : start + MAX_PIECE]
        coded = _dictionary_piece(raw)
        if coded is not None:
            packed, distinct, times = coded
            out = PIECE.pack(len(raw) | DICTIONARY_PIECE, len(packed)) + packed
            census.append((distinct, times))
        else:
            packed = lz4.block.compress(raw, mode="fast", store_size=False)
            out = PIECE.pack(len(raw), len(packed)) + packed
            census.append((np.frombuffer(raw, dtype="<u8"), None))
        write_all(fd, out)
    return census


def read_packed(path: Path) -> np.ndarray:
    """The words of a packed stream file, oldest first."""
    blob = memoryview(path.read_bytes())  # slices of it are views, not copies
    pieces: list[tuple[int, int, int]] = []  # (offset of the packed bytes, raw, packed)
    off = 0
    while off + PIECE.size <= len(blob):
        raw, packed = PIECE.unpack_from(blob, off)
        if (raw & ~DICTIONARY_PIECE) % 8 or raw & ~DICTIONARY_PIECE > MAX_PIECE:
            raise StoreError(f"{path}: not a packed stream (piece at byte {off} is corrupt)")
        if off + PIECE.size + packed > len(blob):
            break  # cut short while being written: its words are still in the ring
        pieces.append((off + PIECE.size, raw, packed))
        off += PIECE.size + packed
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
                f"{path}: piece at byte {start - PIECE.size} is corrupt ({e})"
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


__all__ = ["SUFFIX", "append_packed", "load_dictionary_coder", "read_packed", "write_all"]
