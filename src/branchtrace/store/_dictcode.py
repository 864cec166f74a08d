"""The dictionary coder of packed stream pieces (packed.py), compiled with numba.

Kept apart so that importing the store does not import numba: the recorder loads this in
the background and packs plainly until it is ready.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@nb.njit(nogil=True, cache=True)
def dict_encode(
    words: np.ndarray, ids: np.ndarray, dictionary: np.ndarray, times: np.ndarray, bits: int
) -> int:
    """Number each distinct word in order of appearance: ids[i] is words[i]'s index in
    dictionary, times[k] how often dictionary[k] occurs.  Returns how many distinct words,
    or -1 if more than dictionary holds.  `bits`: log2 of the hash table's size, which
    must exceed dictionary.size."""
    mask = (1 << bits) - 1
    keys = np.empty(1 << bits, np.uint64)
    slots = np.full(1 << bits, -1, np.int32)
    shift = np.uint64(64 - bits)
    n = 0
    for i in range(words.size):
        w = words[i]
        h = np.int64((w * _GOLDEN) >> shift)
        while True:
            s = slots[h]
            if s < 0:
                if n == dictionary.size:
                    return -1
                slots[h] = n
                keys[h] = w
                dictionary[n] = w
                times[n] = 1
                ids[i] = n
                n += 1
                break
            if keys[h] == w:
                ids[i] = s
                times[s] += 1
                break
            h = (h + 1) & mask
    return n
