"""The loops that do not vectorise, compiled with numba: one pass over a thread's words.

`scan_blocks` turns raw ring words into a sequence of block ids (a hash table interns the
distinct BLOCK words, of which a program has thousands, not millions), noting where the
chain of blocks is broken (LOST, GAP) or interrupted (an INTERRUPT branch record, written
at a signal's delivery), and where signal handlers ran untraced.  `call_segments` walks
the block sequence with a shadow stack of return addresses and produces the function-call
history.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from ..store.format import (
    BLOCK_ADDR_BITS,
    BLOCK_ADDR_MASK,
    INTERRUPT_AT_START,
    INTERRUPT_INSIDE,
    LEN_MASK,
    LEN_SHIFT,
    TYPE_MASK,
    TYPE_SHIFT,
    BranchKind,
    GapReason,
    RecordType,
)

#: why the chain breaks before a block (scan_blocks' `breaks`)
BREAK_NONE, BREAK_LOST, BREAK_GAP, BREAK_INTERRUPT, BREAK_SIGRETURN = 0, 1, 2, 3, 4
#: a traced handler's rt_sigreturn, then at once a signal pending meanwhile (detail: where)
BREAK_SIGRETURN_INTERRUPT = 5
#: the stalker engine's INTERRUPTs say where the signal came (INTERRUPT_AT_START,
#: INTERRUPT_INSIDE in store.format): at the start of a block whose record comes after
#: (the block recorded before took its branch there first), or inside the block recorded
#: before.  A plain BREAK_INTERRUPT (the step engine's) is placed by the addresses.
BREAK_INTERRUPT_AT_START, BREAK_INTERRUPT_INSIDE = 6, 7
#: the breaks that are a signal's delivery: each is an INTERRUPT branch, not a gap
SIGNAL_DELIVERIES = (
    BREAK_INTERRUPT,
    BREAK_SIGRETURN_INTERRUPT,
    BREAK_INTERRUPT_AT_START,
    BREAK_INTERRUPT_INSIDE,
)
#: how a call-history segment begins
HOW_START, HOW_CALL, HOW_RETURN, HOW_TAIL, HOW_UNWIND, HOW_JUMP, HOW_RESUME, HOW_SIGNAL = range(8)

# plain numbers: numba compares enums as floats
_LOST, _GAP, _BRANCH, _FAR = (
    np.uint64(int(t))
    for t in (RecordType.LOST, RecordType.GAP, RecordType.BRANCH, RecordType.BLOCK_FAR)
)
_INTERRUPT = np.uint64(int(BranchKind.INTERRUPT))
_SYSCALL_KIND = np.uint64(int(BranchKind.SYSCALL))
_AT_START, _INSIDE = np.uint64(INTERRUPT_AT_START >> 8), np.uint64(INTERRUPT_INSIDE >> 8)
_GAP_SIGNAL = np.uint64(int(GapReason.SIGNAL))
_INTERRUPT_KIND, _CONDITIONAL = int(BranchKind.INTERRUPT), int(BranchKind.CONDITIONAL)
_NOT_A_BRANCH = 0  #: x86.NOT_A_BRANCH
_SIGNAL_FRAME = -2  #: the caller of a signal's frame on the shadow stack: no function's
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


# Numba keeps loops fast only while the arrays they touch stay the same objects, so the
# loops below never grow an array themselves: they stop and say which one is full, the
# caller grows it (O(log n) times) and they resume where they stopped.
_FULL_TABLE, _FULL_UNIQUE, _FULL_BREAKS, _FULL_OUTPUT, _FULL_STACK, _FULL_HANDLERS, _DONE = range(7)


def _doubled(a: np.ndarray) -> np.ndarray:
    b = np.empty(max(2 * a.size, 16), a.dtype)
    b[: a.size] = a
    return b


@nb.njit(cache=True, nogil=True)
def _table(unique, k, bits):  # type: ignore[no-untyped-def]
    keys = np.zeros(1 << bits, np.uint64)
    vals = np.full(1 << bits, -1, np.int32)
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    for j in range(k):
        g = np.int64((unique[j] * _GOLDEN) >> shift) & mask
        while vals[g] >= 0:
            g = (g + 1) & mask
        keys[g] = unique[j]
        vals[g] = j
    return keys, vals


@nb.njit(cache=True, nogil=True, inline="always")
def _unchained(break_at, nbreaks, m):  # type: ignore[no-untyped-def]
    """nbreaks without the signal deliveries chained before block m (_scan_part): a
    record that overrides the pending delivery (lost records, a gap) overrides them too."""
    while nbreaks > 0 and break_at[nbreaks - 1] == m:
        nbreaks -= 1
    return nbreaks


@nb.njit(cache=True, nogil=True)
def _scan_part(
    words,
    state,
    ids,
    base,
    keys,
    vals,
    bits,
    unique,
    break_at,
    break_kind,
    break_detail,
    handler_at,
    handler_times,
):  # type: ignore[no-untyped-def]
    """Scan from state[0] until done or an array is full; state = [i, m, k, nbreaks,
    pending, pending_detail, nhandlers].  Block m is the thread's m-th, written to
    ids[m - base]: the words may be one piece of the thread's, after blocks 0..base-1."""
    n = words.size
    i, m, k, nbreaks, pending = state[0], state[1], state[2], state[3], state[4]
    pending_detail = np.uint64(state[5])
    nhandlers = state[6]
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    why = _DONE
    while i < n:
        w = words[i]
        if w >> np.uint64(63):
            t = (w >> np.uint64(TYPE_SHIFT)) & np.uint64(TYPE_MASK)
            length = np.int64((w >> np.uint64(LEN_SHIFT)) & np.uint64(LEN_MASK))
            if t == _LOST or t == _FAR:  # noqa: SIM109 (numba: no tuple of globals)
                nbreaks = _unchained(break_at, nbreaks, m)
                if pending != BREAK_LOST:
                    pending_detail = np.uint64(0)
                pending = BREAK_LOST
                if t == _FAR:  # a block above 2^47: no user-space code is there
                    pending_detail += np.uint64(1)
                elif length >= 1 and i + 1 < n:
                    pending_detail += words[i + 1]
            elif t == _GAP and (w & np.uint64(0xFF)) == _GAP_SIGNAL:
                # a signal handler's gap is inside a block: the thread resumes where it
                # was, so the chain holds; counted by the block it ran in (the one before m)
                if nhandlers > 0 and handler_at[nhandlers - 1] == m:
                    handler_times[nhandlers - 1] += 1
                elif nhandlers == handler_at.size:
                    why = _FULL_HANDLERS
                    break
                else:
                    handler_at[nhandlers] = m
                    handler_times[nhandlers] = 1
                    nhandlers += 1
            elif t == _GAP:  # any other gap breaks the chain
                if pending != BREAK_LOST:
                    nbreaks = _unchained(break_at, nbreaks, m)
                    pending = BREAK_GAP
                    pending_detail = w & np.uint64(0xFF)
            elif t == _BRANCH and (w & np.uint64(0xFF)) == _INTERRUPT and i + 1 < n:
                where = (w >> np.uint64(8)) & np.uint64(3)
                if pending == BREAK_INTERRUPT or pending >= BREAK_SIGRETURN_INTERRUPT:
                    # another signal came at the first instruction of the handler just
                    # entered, before a block of it ran: both deliveries stay, in order,
                    # breaks before the same block
                    if nbreaks == break_at.size:
                        why = _FULL_BREAKS
                        break
                    break_at[nbreaks] = m
                    break_kind[nbreaks] = pending
                    break_detail[nbreaks] = pending_detail
                    nbreaks += 1
                if pending == BREAK_SIGRETURN:
                    # one pending while a handler ran is delivered as it returns
                    pending = BREAK_SIGRETURN_INTERRUPT
                elif where == _AT_START:
                    pending = BREAK_INTERRUPT_AT_START
                elif where == _INSIDE:
                    pending = BREAK_INTERRUPT_INSIDE
                else:
                    pending = BREAK_INTERRUPT
                pending_detail = words[i + 1]
            elif t == _BRANCH and (w & np.uint64(0xFF)) == _SYSCALL_KIND and i + 1 < n:
                # the stalker engine's way back from a handler it traced: rt_sigreturn
                nbreaks = _unchained(break_at, nbreaks, m)
                pending = BREAK_SIGRETURN
                pending_detail = words[i + 1]
            i += 1 + length
            continue
        if w == 0:
            i += 1
            continue
        if pending != 0 and nbreaks == break_at.size:
            why = _FULL_BREAKS
            break
        h = np.int64((w * _GOLDEN) >> shift) & mask
        while vals[h] >= 0 and keys[h] != w:
            h = (h + 1) & mask
        v = vals[h]
        if v < 0:
            if k == unique.size:
                why = _FULL_UNIQUE
                break
            if 2 * (k + 1) > (1 << bits):  # keep the table at most half full
                why = _FULL_TABLE
                break
            unique[k] = w
            keys[h] = w
            vals[h] = k
            v = k
            k += 1
        ids[m - base] = v
        if pending != 0:
            break_at[nbreaks] = m
            break_kind[nbreaks] = pending
            break_detail[nbreaks] = pending_detail
            nbreaks += 1
            pending = 0
        m += 1
        i += 1
    state[0], state[1], state[2], state[3], state[4] = i, m, k, nbreaks, pending
    state[5] = np.int64(pending_detail)
    state[6] = nhandlers
    return why


class Scan(NamedTuple):
    """What scan_blocks finds in a thread's words.

    ids[i] names the i-th executed block: unique[ids[i]] is its BLOCK word (4 bytes per
    executed block: traces of 100M+ blocks must fit in memory).  Breaks are rare, so they
    are sparse: the chain is broken right before block break_at[j] (len(ids): after the
    last block), for the reason break_kind[j]; break_detail[j] is, for an INTERRUPT, where
    the interrupted code would have continued, for a GAP its GapReason, and for LOST how
    many records were lost.  Signals delivered one at the entry of the handler of the
    one before, before a block of it ran, are as many INTERRUPT breaks before the same
    block, in order (break_at ascending, not strictly).  A signal handler that ran
    untraced (a GAP of reason signal) breaks nothing: it ran inside block
    handler_at[j] - 1, handler_times[j] times."""

    ids: np.ndarray  #: int32
    break_at: np.ndarray  #: int64
    break_kind: np.ndarray  #: uint8
    break_detail: np.ndarray  #: uint64
    unique: np.ndarray  #: uint64
    handler_at: np.ndarray  #: int64, ascending
    handler_times: np.ndarray  #: uint32


class BlockScanner:
    """scan_blocks over a thread's words fed a piece at a time (each whole records), in
    order: each piece's block ids come back as it is fed, and only the distinct blocks,
    the breaks and the handler runs are kept, so that a trace of billions of blocks is
    read in the memory of one piece.  Block indices (break_at, handler_at) count from the
    first block of the first piece."""

    def __init__(self) -> None:
        self.bits = 4
        self.unique = np.empty(1 << (self.bits - 1), np.uint64)
        self.keys, self.vals = _table(self.unique, 0, self.bits)
        self.breaks = (np.empty(16, np.int64), np.empty(16, np.uint8), np.empty(16, np.uint64))
        self.handlers = (np.empty(16, np.int64), np.empty(16, np.uint32))
        self.state = np.zeros(7, np.int64)

    @property
    def block_count(self) -> int:
        """Blocks fed so far."""
        return int(self.state[1])

    @property
    def distinct(self) -> np.ndarray:
        """The BLOCK word of each distinct block so far, by id."""
        return self.unique[: int(self.state[2])]

    @property
    def break_count(self) -> int:
        """Breaks final so far (more may come before block `block_count`)."""
        return int(self.state[3])

    def feed(self, words: np.ndarray) -> np.ndarray:
        """The ids of the blocks in `words`, the next piece (int32)."""
        words = np.ascontiguousarray(words, np.uint64)
        ids = np.empty(words.size, np.int32)  # at most a block a word
        base = self.block_count
        self.state[0] = 0
        while True:
            why = _scan_part(
                words,
                self.state,
                ids,
                base,
                self.keys,
                self.vals,
                self.bits,
                self.unique,
                *self.breaks,
                *self.handlers,
            )
            if why == _DONE:
                return ids[: self.block_count - base]
            if why == _FULL_TABLE:
                self.bits += 1
                self.keys, self.vals = _table(self.unique, int(self.state[2]), self.bits)
            elif why == _FULL_UNIQUE:
                self.unique = _doubled(self.unique)
            elif why == _FULL_HANDLERS:
                self.handlers = (_doubled(self.handlers[0]), _doubled(self.handlers[1]))
            else:
                self.breaks = tuple(_doubled(a) for a in self.breaks)  # type: ignore[assignment]

    def breaks_before(self, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(at, kind, detail) of the breaks before blocks up to `end` (exclusive) that are
        final: those of blocks fed, not of the one to come."""
        n = self.break_count
        k = int(np.searchsorted(self.breaks[0][:n], end, side="left"))
        return self.breaks[0][:k], self.breaks[1][:k], self.breaks[2][:k]

    def finish(self, ids: np.ndarray) -> Scan:
        """The Scan of everything fed, with the blocks' `ids` (every piece's, in order)."""
        m, nbreaks, nhandlers = self.block_count, self.break_count, int(self.state[6])
        at, why = self.breaks[0][:nbreaks], self.breaks[1][:nbreaks]
        detail = self.breaks[2][:nbreaks]
        if self.state[4] != BREAK_NONE:  # records lost, or code untraced, after the last block
            at = np.append(at, np.int64(m))
            why = np.append(why, np.uint8(self.state[4]))
            detail = np.append(detail, self.state[5:6].view(np.uint64))
        handler_at, handler_times = self.handlers[0][:nhandlers], self.handlers[1][:nhandlers]
        return Scan(ids, at, why, detail, self.distinct, handler_at, handler_times)


def scan_blocks(words: np.ndarray) -> Scan:
    """The executed blocks, the chain's breaks and the untraced handler runs in `words`."""
    scanner = BlockScanner()
    return scanner.finish(scanner.feed(words))


def block_bounds(unique: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, last instruction address) of each BLOCK word."""
    start = unique & np.uint64(BLOCK_ADDR_MASK)
    return start, start + (unique >> np.uint64(BLOCK_ADDR_BITS))


_CALL, _ICALL, _RET, _SYSCALL = (
    int(k)
    for k in (BranchKind.CALL, BranchKind.INDIRECT_CALL, BranchKind.RETURN, BranchKind.SYSCALL)
)


@nb.njit(cache=True, nogil=True, inline="always")
def _transfer_kind(src, dst, k, size, hook_reach):  # type: ignore[no-untyped-def]
    """The kind of the transfer from a block's last instruction at src (of kind k and
    length size) to dst; 0 when there is none: a fall-through (a conditional jump not
    taken, a system call that returns to the next instruction, a block split) or the
    relocated head of a hooked function.  A system call ends a Stalker block only by
    chance (its code slab running short), so one that returns where it was is never a
    branch: the same trace either way, as the step engine's."""
    falls = dst == src + size
    if k == _NOT_A_BRANCH:
        if falls or (dst > src and dst - src <= hook_reach):
            return 0
        return _INTERRUPT_KIND
    if falls and (k == _CONDITIONAL or k == _SYSCALL):  # noqa: SIM109 (numba: no tuple of globals)
        return 0
    return k


@nb.njit(cache=True, nogil=True, inline="always")
def _put(out_from, out_to, out_kind, out_block, c, src, dst, k, block):  # type: ignore[no-untyped-def]
    out_from[c] = src
    out_to[c] = dst
    out_kind[c] = k
    out_block[c] = block
    return c + 1


@nb.njit(cache=True, nogil=True)
def branch_part(
    lo,
    hi,
    hook_reach,
    ids,
    break_at,
    break_kind,
    break_detail,
    start,
    last,
    kind,
    size,
    head_at,
    head_to,
    head_kind,
    out_from,
    out_to,
    out_kind,
    out_block,
):  # type: ignore[no-untyped-def]
    """The taken transfers from block i to block i+1 for lo <= i < hi, into the out_*
    arrays (room for hi - lo, and one more per INTERRUPT break); returns how many.  A
    block that ends in no branch and is followed by one starting at the target of the jump
    in the hooked head after it (head_*: decode.hook_heads) took that jump.  See
    decode.branches_of."""
    nbrk = break_at.size
    j = np.searchsorted(break_at, lo + 1)
    c = 0
    for i in range(lo, hi):
        a = ids[i]
        b = ids[i + 1]
        src = last[a]
        while j < nbrk and break_at[j] < i + 1:
            j += 1
        if j < nbrk and break_at[j] == i + 1:
            first = j
            while j < nbrk and break_at[j] == i + 1:
                x = break_detail[j]
                brk = break_kind[j]
                # a handler entered goes to block b, or to where the next signal came: its
                # first instruction, before any block of it ran
                to = break_detail[j + 1] if j + 1 < nbrk and break_at[j + 1] == i + 1 else start[b]
                j += 1
                if j - 1 > first:
                    c = _put(
                        out_from, out_to, out_kind, out_block, c, x, to, _INTERRUPT_KIND, i + 1
                    )
                elif brk == BREAK_SIGRETURN_INTERRUPT:
                    restorer_syscall = src + np.uint64(size[a])
                    c = _put(
                        out_from,
                        out_to,
                        out_kind,
                        out_block,
                        c,
                        restorer_syscall,
                        x,
                        _SYSCALL,
                        i + 1,
                    )
                    c = _put(
                        out_from, out_to, out_kind, out_block, c, x, to, _INTERRUPT_KIND, i + 1
                    )
                elif brk == BREAK_INTERRUPT or brk >= BREAK_INTERRUPT_AT_START:
                    # a signal that came after block a's own branch (at the first instruction
                    # of the block it went to): that branch was taken first
                    if brk == BREAK_INTERRUPT:
                        taken = not (start[a] < x <= src) and x != src + np.uint64(size[a])
                    else:
                        taken = brk == BREAK_INTERRUPT_AT_START
                    k = _transfer_kind(src, x, kind[a], np.uint64(size[a]), hook_reach)
                    if taken and k != 0:
                        c = _put(out_from, out_to, out_kind, out_block, c, src, x, k, i + 1)
                    c = _put(
                        out_from, out_to, out_kind, out_block, c, x, to, _INTERRUPT_KIND, i + 1
                    )
                elif brk == BREAK_SIGRETURN:  # the way back from a traced handler
                    c = _put(out_from, out_to, out_kind, out_block, c, x, start[b], _SYSCALL, i + 1)
            continue
        k = _transfer_kind(src, start[b], kind[a], np.uint64(size[a]), hook_reach)
        if k != 0:
            c = _put(out_from, out_to, out_kind, out_block, c, src, start[b], k, i + 1)
        elif (
            head_kind[a] != 0
            and head_to[a] == start[b]
            and start[b] != src + np.uint64(size[a])  # a block split, run straight on
        ):
            c = _put(
                out_from, out_to, out_kind, out_block, c, head_at[a], start[b], head_kind[a], i + 1
            )
    return c


@nb.njit(cache=True, nogil=True)
def _frame_of(stack, sp, value):  # type: ignore[no-untyped-def]
    """The newest of the first `sp` frames of `stack` that holds `value`; -1 if none."""
    j = sp - 1
    while j >= 0 and stack[j] != value:
        j -= 1
    return j


@nb.njit(cache=True, nogil=True, inline="always")
def _segment(seg_block, seg_depth, seg_func, seg_how, s, block, depth, func, how):  # type: ignore[no-untyped-def]
    """Segment s of the call history; returns s + 1."""
    seg_block[s] = block
    seg_depth[s] = depth
    seg_func[s] = func
    seg_how[s] = how
    return s + 1


@nb.njit(cache=True, nogil=True)
def _calls_part(
    ids,
    break_at,
    break_kind,
    break_detail,
    start,
    last,
    kind,
    size,
    func,
    func_start,
    state,
    ret,
    caller,
    seg_block,
    seg_depth,
    seg_func,
    seg_how,
):  # type: ignore[no-untyped-def]
    """Walk blocks from state[0] until done or an array is full; state = [i, sp, depth,
    cur, s, j_break]."""
    n = ids.size
    i, sp, depth, cur, s, j_break = state[0], state[1], state[2], state[3], state[4], state[5]
    nb_breaks = break_at.size
    why = _DONE
    while i < n - 1:
        while j_break < nb_breaks and break_at[j_break] < i + 1:
            j_break += 1
        chained = j_break + 1  # signals that came at the handler entered before
        while chained < nb_breaks and break_at[chained] == i + 1:
            chained += 1
        if s + chained - j_break > seg_block.size:
            why = _FULL_OUTPUT
            break
        # a signal right after a call pushes two frames, and one more per chained signal
        if sp + 1 + chained - j_break > ret.size:
            why = _FULL_STACK
            break
        b = ids[i]
        nb_ = ids[i + 1]
        tgt = start[nb_]
        nf = func[nb_]
        how = -1
        brk = 0
        resume = np.uint64(0)
        if j_break < nb_breaks and break_at[j_break] == i + 1:
            brk = break_kind[j_break]
            resume = break_detail[j_break]
        if brk == BREAK_SIGRETURN_INTERRUPT:
            j = _frame_of(ret, sp, resume)  # back from one handler, into the next
            if j >= 0:
                depth -= sp - j
                sp = j
        if brk == BREAK_INTERRUPT or brk >= BREAK_SIGRETURN_INTERRUPT:  # a signal delivered
            # a signal that came right after a call or a return of block b: that first
            k = kind[b]
            fall = last[b] + np.uint64(size[b])
            if brk == BREAK_INTERRUPT:
                taken = not (start[b] < resume <= last[b]) and resume != fall
            else:
                taken = brk == BREAK_INTERRUPT_AT_START
            if taken:
                if (k == _CALL or k == _ICALL) and resume != fall:  # noqa: SIM109
                    ret[sp] = fall
                    caller[sp] = cur
                    sp += 1
                    depth += 1
                elif k == _RET:
                    j = _frame_of(ret, sp, resume)
                    if j >= 0:
                        depth -= sp - j
                        sp = j
            # a signal handler entered: like a call that returns to `resume`
            ret[sp] = resume
            caller[sp] = _SIGNAL_FRAME
            sp += 1
            depth += 1
            for j in range(j_break + 1, chained):
                # the handler entered before signal j came, at its first instruction: a
                # segment of no block, then signal j's frame, which returns there
                entered = -1
                for f in range(func_start.size):
                    if func_start[f] == break_detail[j]:
                        entered = f
                        break
                s = _segment(
                    seg_block, seg_depth, seg_func, seg_how, s, i + 1, depth, entered, HOW_SIGNAL
                )
                cur = entered
                ret[sp] = break_detail[j]
                caller[sp] = _SIGNAL_FRAME
                sp += 1
                depth += 1
            how = HOW_SIGNAL
        elif brk != BREAK_NONE:
            # a traced handler's rt_sigreturn, back to where the signal came; or untraced
            # code ran in between (a GAP) or records were lost: the stack stays,
            # but where the trace resumes at the return address of a call on it, that call
            # returned meanwhile (fork(), which runs untraced, returns so)
            j = _frame_of(ret, sp, tgt)
            if j >= 0:
                depth -= sp - j
                sp = j
                how = HOW_RETURN if brk == BREAK_SIGRETURN else HOW_RESUME
            elif nf != cur:
                how = HOW_RESUME
        else:
            k = kind[b]
            fall = last[b] + np.uint64(size[b])
            if (k == _CALL or k == _ICALL) and tgt != fall:  # noqa: SIM109
                ret[sp] = fall
                caller[sp] = cur
                sp += 1
                depth += 1
                how = HOW_CALL
            elif k == _RET or (k == _SYSCALL and tgt != fall):
                # a return, or rt_sigreturn back into interrupted code
                j = _frame_of(ret, sp, tgt)
                if j < 0 and k == _RET and sp > 0 and caller[sp - 1] == _SIGNAL_FRAME:
                    # a handler returns into the restorer, which leaves by rt_sigreturn:
                    # the signal's frame stays until then
                    if nf != cur:
                        how = HOW_JUMP
                elif j < 0 and nf >= 0:
                    j = _frame_of(caller, sp, nf)
                if j >= 0:
                    depth -= sp - j
                    sp = j
                    how = HOW_RETURN
                elif how >= 0:
                    pass
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
                    j = _frame_of(caller, sp, nf)
                    if j >= 0 and nf >= 0:  # longjmp: back into a frame still on the stack
                        depth -= sp - j
                        sp = j
                        how = HOW_UNWIND
                    else:
                        how = HOW_JUMP
            elif nf != cur:
                how = HOW_JUMP  # fell through into the next function
        if how >= 0:
            s = _segment(seg_block, seg_depth, seg_func, seg_how, s, i + 1, depth, nf, how)
            cur = nf
        i += 1
    state[0], state[1], state[2], state[3], state[4], state[5] = i, sp, depth, cur, s, j_break
    return why


def call_segments(
    ids: np.ndarray,
    break_at: np.ndarray,
    break_kind: np.ndarray,
    break_detail: np.ndarray,
    start: np.ndarray,
    last: np.ndarray,
    kind: np.ndarray,
    size: np.ndarray,
    func: np.ndarray,
    func_start: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The function-call history of one thread: (first block, depth, function id, how).

    Per unique block: start/last address, kind and size of its last instruction, the
    function id of its start (-1: none).  func_start[f] is function f's entry address.
    A shadow stack of (return address, caller function) follows calls and returns; a
    return to no address on it (a longjmp-like unwind, an exception's landing pad) pops
    to the nearest frame of the function it lands in, and only when there is none it
    goes one level up (the trace began mid-stack).  Across a break (untraced code, lost
    records) the stack stays, unless the trace resumes at the return address of a call on
    it: that call returned.  A jump to another function's entry is a tail call (same
    depth).  A signal handler entered is a segment one level in (HOW_SIGNAL), also when
    another signal came at its first instruction: a segment with no block of its own.
    Depths start at 0 for the oldest block and may go negative for a trace that begins
    mid-stack; callers rebase them."""
    breaks = (break_at, break_kind, break_detail)
    return CallWalker().walk(ids, breaks, (start, last, kind, size, func, func_start))


class CallWalker:
    """call_segments over a thread's blocks given a piece at a time, in order: the shadow
    stack, depth and current function carry over from piece to piece."""

    def __init__(self) -> None:
        self.ret, self.caller = np.empty(256, np.uint64), np.empty(256, np.int64)
        cap = 1024
        self.seg = [np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap, np.int64)]
        self.seg.append(np.empty(cap, np.uint8))
        self.state = np.zeros(6, np.int64)
        self.started = False
        self.previous = np.zeros(0, np.int32)  #: the last block walked (walk_piece)

    def walk_piece(
        self, scanner: BlockScanner, ids: np.ndarray, tables: tuple[np.ndarray, ...]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """walk() of the blocks `scanner` just found in a piece (`ids`, what its feed()
        returned), with the breaks it found before them; first blocks counted from the
        thread's first.  The tables are per distinct block found so far."""
        if ids.size == 0:
            return tuple(a[:0] for a in self.seg)  # type: ignore[return-value]
        origin = scanner.block_count - ids.size - self.previous.size  # that of ids[0] here
        if self.previous.size:
            ids = np.concatenate([self.previous, ids])
        at, why, detail = scanner.breaks_before(origin + ids.size)
        lo = int(np.searchsorted(at, origin + 1))
        first, depth, fid, how = self.walk(ids, (at[lo:] - origin, why[lo:], detail[lo:]), tables)
        self.previous = ids[-1:].copy()
        return first + origin, depth, fid, how

    def walk(
        self,
        ids: np.ndarray,
        breaks: tuple[np.ndarray, np.ndarray, np.ndarray],
        tables: tuple[np.ndarray, ...],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """call_segments' columns for the segments begun in `ids` (first block: an index
        into `ids`), valid until the next walk; `breaks` and `tables` are call_segments'
        (at, kind, detail) and (start, last, kind, size, func, func_start).  After the
        first piece, ids[0] must be the previous piece's last block, and the breaks those
        before ids[1:] (break_at indexing `ids`)."""
        seg, state = self.seg, self.state
        state[0], state[4], state[5] = 0, 0, 0
        if not self.started:
            if ids.size == 0:
                return seg[0][:0], seg[1][:0], seg[2][:0], seg[3][:0]
            first = int(tables[4][ids[0]])
            seg[0][0], seg[1][0], seg[2][0], seg[3][0] = 0, 0, first, HOW_START
            state[3], state[4] = first, 1
            self.started = True
        while True:
            why = _calls_part(ids, *breaks, *tables, state, self.ret, self.caller, *seg)  # type: ignore[call-arg]
            if why == _DONE:
                break
            if why == _FULL_OUTPUT:
                seg = self.seg = [_doubled(a) for a in seg]
            else:
                self.ret, self.caller = _doubled(self.ret), _doubled(self.caller)
        s = int(state[4])
        return seg[0][:s], seg[1][:s], seg[2][:s], seg[3][:s]


def within_calls(depth: np.ndarray, entered: np.ndarray) -> np.ndarray:
    """Which segments lie inside a call that starts at an `entered` segment: from it up to
    the first later segment shallower than it.  One pass, however many calls."""
    return within_calls_part(depth, entered, np.zeros(2, np.int64))


@nb.njit(cache=True, nogil=True)
def within_calls_part(depth, entered, state):  # type: ignore[no-untyped-def]
    """within_calls of the next segments of a history read a piece at a time; state =
    [inside a call, its depth], carried from piece to piece (zeros at the start)."""
    n = depth.size
    inside = np.zeros(n, np.bool_)
    open_, at = state[0], state[1]
    for i in range(n):
        if open_ and depth[i] < at:
            open_ = 0
        if not open_ and entered[i]:
            open_, at = 1, depth[i]
        inside[i] = open_ == 1
    state[0], state[1] = open_, at
    return inside
