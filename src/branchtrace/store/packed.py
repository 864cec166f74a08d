"""Compressed stream files (`T<tid>.stream.lz4`): what stream mode drains, LZ4-compressed.

A stream recording is bound by the bytes it writes, not by the tracing: 100M calls make
2.4 GB of BLOCK words, and on a VM every fresh page of page cache costs a fault in the
hypervisor too (measured here: 0.26-1.5 GB/s into tmpfs, 0.27-0.39 GB/s into ext4).  Block
words repeat as the program loops, so LZ4 shrinks them ~33x at ~4 GB/s (a fib trace), like
`perf record -z` does with zstd.  The drain thread compresses (python-lz4 lets go of the
GIL meanwhile).

The file is a sequence of pieces, one per drain, each whole records:

    u64 raw_bytes, u64 packed_bytes, then packed_bytes of one LZ4 block (the LZ4 *block*
    format, no frame) that decompresses to raw_bytes of little-endian words.

A piece cut short (the tool killed while writing it) is not part of the stream: the ring
was advanced only after the write, so those words are still in the ring.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import lz4.block
import numpy as np

from ..errors import StoreError

PIECE = struct.Struct("<QQ")
SUFFIX = ".lz4"
#: LZ4 blocks hold at most ~2 GB; a drain larger than this is split
MAX_PIECE = 64 << 20


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until all of `data` is written (a write may take only part of it)."""
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def append_packed(fd: int, data: memoryview) -> int:
    """Append `data` (whole records) to the packed stream open at `fd`; bytes written."""
    written = 0
    for start in range(0, len(data), MAX_PIECE):
        raw = data[start : start + MAX_PIECE]
        packed = lz4.block.compress(raw, mode="fast", store_size=False)
        out = PIECE.pack(len(raw), len(packed)) + packed
        write_all(fd, out)
        written += len(out)
    return written


def read_packed(path: Path) -> np.ndarray:
    """The words of a packed stream file, oldest first."""
    blob = memoryview(path.read_bytes())  # slices of it are views, not copies
    pieces: list[tuple[int, int, int]] = []  # (offset of the packed bytes, raw, packed)
    off = 0
    while off + PIECE.size <= len(blob):
        raw, packed = PIECE.unpack_from(blob, off)
        if raw % 8 or raw > MAX_PIECE:
            raise StoreError(f"{path}: not a packed stream (piece at byte {off} is corrupt)")
        if off + PIECE.size + packed > len(blob):
            break  # cut short while being written: its words are still in the ring
        pieces.append((off + PIECE.size, raw, packed))
        off += PIECE.size + packed
    words = np.empty(sum(raw for _, raw, _ in pieces) // 8, dtype="<u8")
    out = words.view(np.uint8)
    at = 0
    for start, raw, packed in pieces:
        try:
            chunk = lz4.block.decompress(blob[start : start + packed], uncompressed_size=raw)
        except lz4.block.LZ4BlockError as e:
            raise StoreError(
                f"{path}: piece at byte {start - PIECE.size} is corrupt ({e})"
            ) from None
        out[at : at + raw] = np.frombuffer(chunk, dtype=np.uint8)
        at += raw
    return words


__all__ = ["SUFFIX", "append_packed", "read_packed", "write_all"]
