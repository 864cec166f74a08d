"""The loop that expands block slots into BLOCK words (records.expand_slots), compiled with
numba: one pass over the words, where numpy needed a dozen (90M records: ~1.5 s -> ~0.2 s).

Kept apart so that importing the store does not import numba: only readers of a ring with
a block table load it, the recorder never does.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_LOW = np.uint64(0xFFFFFFFF)


@nb.njit(cache=True, nogil=True)
def expand(words, entries, out, at, addr_mask, far_type):  # type: ignore[no-untyped-def]
    """Expand `words` into out[at:]; returns the new `at`, or -1 - i if words[i] holds
    no valid block id.  A BLOCK_FAR record whose start fits a BLOCK word becomes one."""
    n = words.size
    limit = np.uint64(entries.size)
    i = 0
    while i < n:
        w = words[i]
        if w >> np.uint64(63):
            length = np.int64((w >> np.uint64(40)) & np.uint64(0xFFFF))
            kind = (w >> np.uint64(56)) & np.uint64(0x7F)
            offset = w & np.uint64(0xFFFFFFFFFF)
            if (
                kind == far_type
                and length == 1
                and i + 1 < n
                and words[i + 1] <= addr_mask
                and offset <= np.uint64(0xFFFF)
            ):
                out[at] = words[i + 1] | (offset << np.uint64(47))
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
