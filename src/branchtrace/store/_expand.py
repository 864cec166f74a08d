"""The loop that expands block slots into BLOCK words (records.expand_slots), compiled with
numba: one pass over the words, where numpy needed a dozen (90M records of a call loop:
1.3-1.7 s in numpy, 0.15 s at best here; page faults of the result add up to ~1.2 s).

Kept apart so that importing the store does not import numba: only readers of a ring with
a block table load it, the recorder never does.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from .format import (
    ARG_MASK,
    BLOCK_ADDR_BITS,
    BLOCK_ADDR_MASK,
    BLOCK_OFF_MASK,
    LEN_MASK,
    LEN_SHIFT,
    TYPE_MASK,
    TYPE_SHIFT,
    RecordType,
)

# plain numbers: numba compares enums as floats
_LOW = np.uint64(0xFFFFFFFF)
_FAR = np.uint64(int(RecordType.BLOCK_FAR))
_ADDR_MASK, _OFF_MASK, _ARG_MASK = (
    np.uint64(m) for m in (BLOCK_ADDR_MASK, BLOCK_OFF_MASK, ARG_MASK)
)
_LEN_SHIFT, _LEN_MASK = np.uint64(LEN_SHIFT), np.uint64(LEN_MASK)
_TYPE_SHIFT, _TYPE_MASK = np.uint64(TYPE_SHIFT), np.uint64(TYPE_MASK)
_ADDR_BITS = np.uint64(BLOCK_ADDR_BITS)


@nb.njit(cache=True, nogil=True)
def expand(words, entries, out, at):  # type: ignore[no-untyped-def]
    """Expand `words` into out[at:]; returns the new `at`, or -1 - i if words[i] holds
    no valid block id.  A BLOCK_FAR record whose start fits a BLOCK word becomes one."""
    n = words.size
    limit = np.uint64(entries.size)
    i = 0
    while i < n:
        w = words[i]
        if w >> np.uint64(63):
            length = np.int64((w >> _LEN_SHIFT) & _LEN_MASK)
            offset = w & _ARG_MASK
            if (
                (w >> _TYPE_SHIFT) & _TYPE_MASK == _FAR
                and length == 1
                and i + 1 < n
                and words[i + 1] <= _ADDR_MASK
                and offset <= _OFF_MASK
            ):
                out[at] = words[i + 1] | (offset << _ADDR_BITS)
                at += 1
                i += 2
                continue
            end = min(n, i + 1 + length)
            while i < end:
                out[at] = words[i]
                at += 1
                i += 1
            continue
        low = w & _LOW
        high = w >> np.uint64(32)
        if low == 0 or low >= limit or high >= limit:
            return -1 - i
        out[at] = entries[low]
        at += 1
        if high != 0:
            out[at] = entries[high]
            at += 1
        i += 1
    return at
