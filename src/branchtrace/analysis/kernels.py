"""The loops that do not vectorise, compiled with numba: one pass over a thread's words.

`scan_blocks` turns raw ring words into a sequence of block ids (a hash table interns the
distinct BLOCK words, of which a program has thousands, not millions), noting where the
chain of blocks is broken (LOST, GAP) or interrupted (an explicit INTERRUPT branch record,
written by the step engine at signal delivery).  `call_segments` walks the block sequence
with a shadow stack of return addresses and produces the function-call history.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from ..store.format import (
    BLOCK_ADDR_BITS,
    BLOCK_ADDR_MASK,
    LEN_MASK,
    LEN_SHIFT,
    TYPE_MASK,
    TYPE_SHIFT,
    BranchKind,
    RecordType,
)

#: why the chain breaks before a block (scan_blocks' `breaks`)
BREAK_NONE, BREAK_LOST, BREAK_GAP, BREAK_INTERRUPT = 0, 1, 2, 3
#: how a call-history segment begins
HOW_START, HOW_CALL, HOW_RETURN, HOW_TAIL, HOW_UNWIND, HOW_JUMP, HOW_RESUME, HOW_SIGNAL = range(8)

# plain numbers: numba compares enums as floats
_LOST, _GAP, _BRANCH, _FAR = (
    np.uint64(int(t))
    for t in (RecordType.LOST, RecordType.GAP, RecordType.BRANCH, RecordType.BLOCK_FAR)
)
_INTERRUPT = np.uint64(int(BranchKind.INTERRUPT))
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@nb.njit(cache=True, nogil=True)
def _grow(a, n):  # type: ignore[no-untyped-def]
    b = np.empty(max(n, 2 * a.size), a.dtype)
    b[: a.size] = a
    return b


@nb.njit(cache=True, nogil=True)
def scan_blocks(words):  # type: ignore[no-untyped-def]
    """(ids int32, word index int64, breaks uint8, resume uint64, unique words uint64).

    ids[i] names the i-th executed block: unique[ids[i]] is its BLOCK word.  breaks[i] says
    why the chain is broken right before block i; resume[i] is, for an INTERRUPT, where the
    interrupted code would have continued."""
    n = words.size
    ids = np.empty(n, np.int32)
    widx = np.empty(n, np.int64)
    breaks = np.zeros(n, np.uint8)
    resume = np.zeros(n, np.uint64)
    bits = 4  # grows by doubling; small to start, as most programs have few blocks
    keys = np.zeros(1 << bits, np.uint64)
    vals = np.full(1 << bits, -1, np.int32)
    unique = np.empty(1024, np.uint64)
    k = 0
    m = 0
    pending = 0
    pending_resume = np.uint64(0)
    i = 0
    shift_type = np.uint64(TYPE_SHIFT)
    shift_len = np.uint64(LEN_SHIFT)
    while i < n:
        w = words[i]
        if w >> np.uint64(63):
            t = (w >> shift_type) & np.uint64(TYPE_MASK)
            length = (w >> shift_len) & np.uint64(LEN_MASK)
            if t in (_LOST, _FAR):
                pending = BREAK_LOST
            elif t == _GAP:
                if pending != BREAK_LOST:
                    pending = BREAK_GAP
            elif t == _BRANCH and (w & np.uint64(0xFF)) == _INTERRUPT and i + 1 < n:
                pending = BREAK_INTERRUPT
                pending_resume = words[i + 1]
            i += 1 + np.int64(length)
            continue
        if w == 0:
            i += 1
            continue
        mask = np.uint64((1 << bits) - 1)
        h = np.int64(((w * _GOLDEN) >> np.uint64(64 - bits)) & mask)
        while vals[h] >= 0 and keys[h] != w:
            h = (h + 1) & np.int64(mask)
        if vals[h] < 0:
            if k == unique.size:
                unique = _grow(unique, k + 1)
            unique[k] = w
            keys[h] = w
            vals[h] = k
            k += 1
            if 2 * k > (1 << bits):  # rehash at half full
                bits += 1
                keys = np.zeros(1 << bits, np.uint64)
                vals = np.full(1 << bits, -1, np.int32)
                mask = np.uint64((1 << bits) - 1)
                for j in range(k):
                    g = np.int64(((unique[j] * _GOLDEN) >> np.uint64(64 - bits)) & mask)
                    while vals[g] >= 0:
                        g = (g + 1) & np.int64(mask)
                    keys[g] = unique[j]
                    vals[g] = j
                h = -1
            ids[m] = k - 1
        else:
            ids[m] = vals[h]
        widx[m] = i
        breaks[m] = pending
        resume[m] = pending_resume
        pending = 0
        m += 1
        i += 1
    return ids[:m], widx[:m], breaks[:m], resume[:m], unique[:k]


def block_bounds(unique: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, last instruction address) of each BLOCK word."""
    start = unique & np.uint64(BLOCK_ADDR_MASK)
    return start, start + (unique >> np.uint64(BLOCK_ADDR_BITS))


_CALL, _ICALL, _RET, _SYSCALL = (
    int(k)
    for k in (BranchKind.CALL, BranchKind.INDIRECT_CALL, BranchKind.RETURN, BranchKind.SYSCALL)
)


@nb.njit(cache=True, nogil=True)
def call_segments(ids, breaks, resume, start, last, kind, size, func, func_start):  # type: ignore[no-untyped-def]
    """The function-call history of one thread: (first block, depth, function id, how).

    Per unique block: start/last address, kind and size of its last instruction, the
    function id of its start (-1: none).  func_start[f] is function f's entry address.
    A shadow stack of (return address, caller function) follows calls and returns; a
    return to no address on it (a longjmp-like unwind, an exception's landing pad) pops
    to the nearest frame of the function it lands in, and only when there is none it
    goes one level up (the trace began mid-stack).  A jump to another function's entry
    is a tail call (same depth).  Depths start at 0 for the oldest block and may go
    negative for a trace that begins mid-stack; callers rebase them."""
    n = ids.size
    seg_block = np.empty(n + 1, np.int64)
    seg_depth = np.empty(n + 1, np.int64)
    seg_func = np.empty(n + 1, np.int64)
    seg_how = np.empty(n + 1, np.uint8)
    if n == 0:
        return seg_block[:0], seg_depth[:0], seg_func[:0], seg_how[:0]
    ret = np.empty(1024, np.uint64)
    caller = np.empty(1024, np.int64)
    sp = 0
    depth = 0
    cur = func[ids[0]]
    s = 0
    seg_block[0] = 0
    seg_depth[0] = 0
    seg_func[0] = cur
    seg_how[0] = HOW_START
    s = 1
    for i in range(n - 1):
        b = ids[i]
        nb_ = ids[i + 1]
        tgt = start[nb_]
        nf = func[nb_]
        how = -1
        brk = breaks[i + 1]
        if brk == BREAK_INTERRUPT:
            # a signal handler entered: like a call that returns to `resume`
            if sp == ret.size:
                ret = _grow(ret, sp + 1)
                caller = _grow(caller, sp + 1)
            ret[sp] = resume[i + 1]
            caller[sp] = cur
            sp += 1
            depth += 1
            how = HOW_SIGNAL
        elif brk != BREAK_NONE:
            # untraced code ran in between (a GAP) or records were lost: the stack stays
            if nf != cur:
                how = HOW_RESUME
        else:
            k = kind[b]
            fall = last[b] + np.uint64(size[b])
            if (k in (_CALL, _ICALL)) and tgt != fall:
                if sp == ret.size:
                    ret = _grow(ret, sp + 1)
                    caller = _grow(caller, sp + 1)
                ret[sp] = fall
                caller[sp] = cur
                sp += 1
                depth += 1
                how = HOW_CALL
            elif k == _RET or (k == _SYSCALL and tgt != fall):
                # a return, or rt_sigreturn back into interrupted code
                j = sp - 1
                while j >= 0 and ret[j] != tgt:
                    j -= 1
                if j < 0 and nf >= 0:
                    j = sp - 1
                    while j >= 0 and caller[j] != nf:
                        j -= 1
                if j >= 0:
                    depth -= sp - j
                    sp = j
                    how = HOW_RETURN
                elif k == _RET:
                    depth -= 1  # returned above the oldest recorded frame
                    sp = 0
                    how = HOW_RETURN
                elif nf != cur:
                    how = HOW_JUMP
            elif tgt != fall and nf != cur:
                if nf >= 0 and tgt == func_start[nf]:
                    how = HOW_TAIL
                else:
                    j = sp - 1
                    while j >= 0 and caller[j] != nf:
                        j -= 1
                    if j >= 0 and nf >= 0:  # longjmp: back into a frame still on the stack
                        depth -= sp - j
                        sp = j
                        how = HOW_UNWIND
                    else:
                        how = HOW_JUMP
            elif nf != cur:
                how = HOW_JUMP  # fell through into the next function
        if how >= 0:
            seg_block[s] = i + 1
            seg_depth[s] = depth
            seg_func[s] = nf
            seg_how[s] = how
            s += 1
            cur = nf
    return seg_block[:s], seg_depth[:s], seg_func[:s], seg_how[:s]
