"""The numba block scanner and the call-history kernel, against plain references, on
generated record streams (hypothesis)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from branchtrace.analysis.decode import Blocks, branches_of
from branchtrace.analysis.kernels import (
    BREAK_GAP,
    BREAK_INTERRUPT,
    BREAK_INTERRUPT_AT_START,
    BREAK_INTERRUPT_INSIDE,
    BREAK_LOST,
    BREAK_NONE,
    BREAK_SIGRETURN,
    BREAK_SIGRETURN_INTERRUPT,
    HOW_JUMP,
    HOW_RETURN,
    HOW_SIGNAL,
    HOW_START,
    BlockScanner,
    CallWalker,
    block_bounds,
    call_segments,
    scan_blocks,
    within_calls,
    within_calls_part,
)
from branchtrace.analysis.trace import faults_in, thread_end
from branchtrace.store import BranchKind, RecordType, parse_words
from branchtrace.store.format import (
    INTERRUPT_AT_START,
    INTERRUPT_INSIDE,
    GapReason,
    record_words,
)
from branchtrace.x86 import NOT_A_BRANCH

# few distinct blocks (as in a real program) and occasionally many: the hash table grows
starts = st.one_of(st.integers(0x1000, 0x1040), st.integers(1, (1 << 47) - 1))
blocks = st.tuples(st.just(RecordType.BLOCK), st.integers(0, 200), starts)
others = st.one_of(
    st.tuples(st.just(RecordType.LOST), st.just(0), st.integers(1, 1 << 40)),
    st.tuples(st.just(RecordType.TIME), st.just(0), st.integers(0, 1 << 60)),
    st.tuples(st.just(RecordType.GAP), st.sampled_from([int(r) for r in GapReason])),
    st.tuples(
        st.just(RecordType.BRANCH),
        st.sampled_from(
            [
                int(BranchKind.INTERRUPT),  # the step engine's
                int(BranchKind.INTERRUPT) | INTERRUPT_AT_START,  # the stalker engine's
                int(BranchKind.INTERRUPT) | INTERRUPT_INSIDE,
                int(BranchKind.SYSCALL),  # the stalker engine's way back from a handler
            ]
        ),
        st.integers(1, (1 << 47) - 1),
        st.integers(1, (1 << 47) - 1),
    ),
)
streams = st.lists(st.one_of(blocks, blocks, blocks, others), max_size=300)


def dense_breaks(n: int, at: np.ndarray, kind: np.ndarray, lo: int = 0) -> np.ndarray:
    """The break kind before each of blocks lo .. lo+n-1 (BREAK_NONE mostly): the
    scanner's sparse breaks, spread out for comparison."""
    out = np.zeros(n, np.uint8)
    sel = (at >= lo) & (at < lo + n)
    out[at[sel] - lo] = kind[sel]
    return out


DELIVERIES = (
    BREAK_INTERRUPT,
    BREAK_SIGRETURN_INTERRUPT,
    BREAK_INTERRUPT_AT_START,
    BREAK_INTERRUPT_INSIDE,
)


def reference(recs: list[tuple]) -> tuple[list[int], list[tuple[int, int, int]], Counter]:
    """Block words, and the breaks (before which block, kind, detail: INTERRUPT: the
    resume address, GAP: the reason, LOST: the records lost since the last block), the
    slow way; a break may come after the last block, and a signal that came at the first
    instruction of the handler just entered is a second delivery before the same block.
    And the untraced signal handler runs, by the number of blocks before them."""
    words: list[int] = []
    breaks: list[tuple[int, int, int]] = []
    handlers: Counter = Counter()
    chained: list[tuple[int, int]] = []  # deliveries before the pending one
    pending, detail = BREAK_NONE, 0
    for rtype, arg, *payload in recs:
        if rtype == RecordType.GAP and arg == GapReason.SIGNAL:
            handlers[len(words)] += 1  # inside a block: the thread resumes where it was
            continue
        if rtype == RecordType.BLOCK:
            if pending != BREAK_NONE:
                breaks += [(len(words), k, d) for k, d in [*chained, (pending, detail)]]
            words.append(payload[0] | (arg << 47))
            chained, pending = [], BREAK_NONE
        elif rtype == RecordType.LOST:
            detail = (detail if pending == BREAK_LOST else 0) + payload[0]
            chained, pending = [], BREAK_LOST
        elif rtype == RecordType.GAP and pending != BREAK_LOST:
            chained, pending, detail = [], BREAK_GAP, arg
        elif rtype == RecordType.BRANCH and arg == BranchKind.SYSCALL:
            chained, pending, detail = [], BREAK_SIGRETURN, payload[0]
        elif rtype == RecordType.BRANCH:
            if pending in DELIVERIES:
                chained.append((pending, detail))
            if pending == BREAK_SIGRETURN:
                pending = BREAK_SIGRETURN_INTERRUPT
            elif arg & INTERRUPT_AT_START:
                pending = BREAK_INTERRUPT_AT_START
            elif arg & INTERRUPT_INSIDE:
                pending = BREAK_INTERRUPT_INSIDE
            else:
                pending = BREAK_INTERRUPT
            detail = payload[0]
    if pending != BREAK_NONE:  # after the last block
        breaks += [(len(words), k, d) for k, d in [*chained, (pending, detail)]]
    return words, breaks, handlers


@settings(max_examples=300, deadline=None)
@given(streams)
def test_scan_blocks_agrees_with_the_reference_parser(recs):
    words = np.array([w for r in recs for w in record_words(*r)], dtype=np.uint64)
    ids, at, why, detail, unique, handler_at, handler_times = scan_blocks(words)
    want_words, want_breaks, want_handlers = reference(recs)
    assert unique[ids].tolist() == want_words
    got = list(zip(at.tolist(), why.tolist(), detail.tolist(), strict=True))
    assert got == [(m, k, d % (1 << 64)) for m, k, d in want_breaks]
    assert len(set(unique.tolist())) == unique.size  # each distinct block interned once
    assert dict(zip(handler_at.tolist(), handler_times.tolist(), strict=True)) == want_handlers
    assert handler_at.tolist() == sorted(want_handlers)  # once per place, oldest first
    if words.size:
        parsed = parse_words(words)
        start, last = block_bounds(unique[ids])
        assert start.tolist() == parsed["a"][parsed["type"] == RecordType.BLOCK].tolist()
        assert last.tolist() == parsed["b"][parsed["type"] == RecordType.BLOCK].tolist()


def test_untraced_handler_runs_are_counted_by_place_however_many_places():
    # more places than the scanner's first arrays hold (16): they grow
    recs = []
    for i in range(40):
        recs.append((RecordType.BLOCK, 3, 0x1000 + 16 * i))
        recs += [(RecordType.GAP, int(GapReason.SIGNAL))] * (2 if i == 5 else 1)
    words = np.array([w for r in recs for w in record_words(*r)], dtype=np.uint64)
    found = scan_blocks(words)
    assert found.ids.size == 40 and found.break_at.size == 0  # the chain holds
    assert found.handler_at.tolist() == list(range(1, 41))
    assert found.handler_times.tolist() == [1] * 5 + [2] + [1] * 34


def test_a_signal_at_the_entry_of_the_handler_just_entered_is_a_second_delivery():
    # the records of a twosignals thread (session 67; 5 runs of 55 of a 1M-round build
    # had one): SIGALRM came after libc's rt_sigprocmask() that unblocked it, inside the
    # block at 0x7e63, and SIGUSR1 at its handler's first instruction, before a block of
    # the handler ran; each handler returned through the restorer's rt_sigreturn to where
    # its signal came.  Read as one delivery, the second, the block's jne looked taken
    # into the handler.
    on_signal, restorer, after_mask = 0x51C8, 0x3050, 0x7E7A
    interrupt = int(BranchKind.INTERRUPT)
    recs = [
        (RecordType.BLOCK, 0x27, 0x7E63),  # its syscall at 0x7e78, its jne at 0x7e8a
        (RecordType.BRANCH, interrupt | INTERRUPT_INSIDE, after_mask, on_signal),
        (RecordType.BRANCH, interrupt | INTERRUPT_AT_START, on_signal, on_signal),
        (RecordType.BLOCK, 0x14, on_signal),  # its ret at 0x51dc
        (RecordType.BLOCK, 7, restorer),  # its syscall at 0x3057
        (RecordType.BRANCH, int(BranchKind.SYSCALL), restorer + 7, on_signal),
        (RecordType.BLOCK, 0x14, on_signal),
        (RecordType.BLOCK, 7, restorer),
        (RecordType.BRANCH, int(BranchKind.SYSCALL), restorer + 7, after_mask),
        (RecordType.BLOCK, 0x10, after_mask),
    ]
    words = np.array([w for r in recs for w in record_words(*r)], dtype=np.uint64)
    found = scan_blocks(words)
    start, last = block_bounds(found.unique)
    func = {0x7E63: 0, after_mask: 0, on_signal: 1, restorer: 2}
    last_insn = [
        (BranchKind.CONDITIONAL, 6),
        (BranchKind.RETURN, 1),
        (BranchKind.SYSCALL, 2),
    ]
    b = Blocks.of_scan(
        found,
        start,
        last,
        np.array([last_insn[func[x]][0] for x in start.tolist()], np.uint8),
        np.array([last_insn[func[x]][1] for x in start.tolist()], np.uint64),
    )
    got = [(f, t, k) for f, t, k, _ in branches_of(b).tolist()]
    assert got == [
        (after_mask, on_signal, BranchKind.INTERRUPT),  # the jne had not run yet
        (on_signal, on_signal, BranchKind.INTERRUPT),
        (on_signal + 0x14, restorer, BranchKind.RETURN),
        (restorer + 7, on_signal, BranchKind.SYSCALL),
        (on_signal + 0x14, restorer, BranchKind.RETURN),
        (restorer + 7, after_mask, BranchKind.SYSCALL),
    ]
    segments = call_segments(
        *b.kernel_args(),
        np.array([func[x] for x in start.tolist()], np.int64),
        np.array([0x7E00, on_signal, restorer], np.uint64),
    )
    assert [tuple(x.tolist()) for x in segments] == [
        (0, 1, 1, 2, 3, 4, 5),  # first block: the first handler's entry has none of its own
        (0, 1, 2, 2, 1, 1, 0),  # depth: each handler one level in, returning one at a time
        (0, 1, 1, 2, 1, 2, 0),  # function
        (HOW_START, HOW_SIGNAL, HOW_SIGNAL, HOW_JUMP, HOW_RETURN, HOW_JUMP, HOW_RETURN),
    ]


def made_up_tables(unique: np.ndarray) -> tuple[np.ndarray, ...]:
    """start, last, kind, size, func of each distinct block word, made up from the word
    alone (the same whichever piece found it): every kind of last instruction, five
    functions whose entries are among the blocks' starts."""
    start, last = block_bounds(unique)
    choices = np.array([NOT_A_BRANCH, *map(int, BranchKind)], np.uint8)
    kind = choices[(unique % np.uint64(choices.size)).astype(np.int64)]
    size = np.uint64(1) + (unique >> np.uint64(3)) % np.uint64(15)
    func = ((start >> np.uint64(4)) % np.uint64(6)).astype(np.int64) - 1  # -1: no symbol
    return start, last, kind, size, func


@settings(max_examples=300, deadline=None)
@given(streams, st.lists(st.integers(0, 300), max_size=8))
def test_scanning_and_walking_piece_by_piece_agrees_with_the_whole(recs, cuts):
    """A thread's words decoded a piece at a time (views of traces larger than memory):
    the same blocks, breaks, handler runs and call history as decoded whole, wherever
    the pieces are cut between records (a signal's deliveries chained before a block of
    the next piece, lost records after them, ...)."""
    record_list = [record_words(*r) for r in recs]
    bounds = [0, *sorted({min(c, len(recs)) for c in cuts}), len(recs)]
    pieces = [
        np.array([w for r in record_list[a:b] for w in r], dtype=np.uint64)
        for a, b in itertools.pairwise(bounds)
    ]
    whole = scan_blocks(np.concatenate(pieces))
    func_start = np.array([0x1000 + 16 * f for f in range(5)], np.uint64)
    scanner, walker = BlockScanner(), CallWalker()
    ids, segments = [], []
    for piece in pieces:
        found = scanner.feed(piece)
        ids.append(found)
        tables = made_up_tables(scanner.distinct)
        segments.append(
            [a.copy() for a in walker.walk_piece(scanner, found, (*tables, func_start))]
        )
    got = scanner.finish(np.concatenate(ids))
    for name, want in whole._asdict().items():
        assert np.array_equal(getattr(got, name), want), name
    want_segments = call_segments(
        *whole[:4], *made_up_tables(whole.unique)[:4], made_up_tables(whole.unique)[4], func_start
    )
    for got_column, want_column in zip(
        (np.concatenate(c) for c in zip(*segments, strict=True)), want_segments, strict=True
    ):
        assert got_column.tolist() == want_column.tolist()


def reference_branches(b: Blocks) -> list[tuple[int, int, int, int]]:
    """decode.branches_of, one block pair at a time."""
    breaks: dict[int, list[tuple[int, int]]] = {}
    for m, why, x in zip(
        b.break_at.tolist(), b.break_kind.tolist(), b.break_detail.tolist(), strict=True
    ):
        breaks.setdefault(m, []).append((why, x))
    out = []
    for i in range(b.ids.size - 1):
        a, n = int(b.ids[i]), int(b.ids[i + 1])
        src, dst, kind = int(b.last[a]), int(b.start[n]), int(b.kind[a])
        if i + 1 not in breaks:
            out += transfer(src, dst, kind, int(b.size[a]), i + 1)
            continue
        (why, x), *chained = breaks[i + 1]
        # each handler entered goes to where the next signal came, the last to block n
        to = chained[0][1] if chained else dst
        if why == BREAK_SIGRETURN:
            out.append((x, dst, BranchKind.SYSCALL, i + 1))
        elif why == BREAK_SIGRETURN_INTERRUPT:
            out.append((src + int(b.size[a]), x, BranchKind.SYSCALL, i + 1))
            out.append((x, to, BranchKind.INTERRUPT, i + 1))
        elif why in (BREAK_INTERRUPT, BREAK_INTERRUPT_AT_START, BREAK_INTERRUPT_INSIDE):
            # block a took its branch before the signal came: at x, where it went
            inside = int(b.start[a]) < x <= src or x == src + int(b.size[a])
            if why == BREAK_INTERRUPT_AT_START or (why == BREAK_INTERRUPT and not inside):
                out += transfer(src, x, kind, int(b.size[a]), i + 1)
            out.append((x, to, BranchKind.INTERRUPT, i + 1))
        for k, (_, y) in enumerate(chained):
            to = chained[k + 1][1] if k + 1 < len(chained) else dst
            out.append((y, to, BranchKind.INTERRUPT, i + 1))
    return out


def transfer(src: int, dst: int, kind: int, size: int, block: int) -> list[tuple]:
    """The branch from a block's last instruction at src (of that kind and size) to dst,
    if it is one: not a fall-through (a system call's included), nor a hooked function's
    relocated head."""
    falls = dst == src + size
    if kind == NOT_A_BRANCH:
        if falls or 0 < dst - src <= 32:
            return []
        kind = BranchKind.INTERRUPT
    elif falls and kind in (BranchKind.CONDITIONAL, BranchKind.SYSCALL):
        return []
    return [(src, dst, kind, block)]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 12).flatmap(
        lambda k: st.tuples(
            st.lists(st.integers(0, k - 1), min_size=0, max_size=200),
            st.lists(st.integers(0x1000, 0x1100), min_size=k, max_size=k),
            st.lists(st.integers(0, 40), min_size=k, max_size=k),
            st.lists(st.sampled_from([0, *map(int, BranchKind), 255]), min_size=k, max_size=k),
            st.lists(st.integers(1, 15), min_size=k, max_size=k),
            st.lists(
                st.sampled_from(
                    [
                        BREAK_LOST,
                        BREAK_GAP,
                        BREAK_INTERRUPT,
                        BREAK_SIGRETURN,
                        BREAK_SIGRETURN_INTERRUPT,
                        BREAK_INTERRUPT_AT_START,
                        BREAK_INTERRUPT_INSIDE,
                    ]
                ),
                max_size=5,
            ),
        )
    ),
    st.randoms(use_true_random=False),
)
def test_branches_of_agrees_with_a_pairwise_reference(blocks_spec, rnd):
    ids, starts, offsets, kinds, sizes, break_kinds = blocks_spec
    # blocks laid end to end, as code is: block j+1 starts where block j falls through to,
    # so that fall-throughs, hook-sized skips and real jumps all occur
    starts = [0x1000]
    for off, size in zip(offsets[:-1], sizes[:-1], strict=True):
        starts.append(starts[-1] + off + size)
    ids = np.array(
        [i if rnd.random() < 0.3 else min(i + 1, len(starts) - 1) for i in ids], np.int32
    )
    at = np.array(
        sorted(rnd.sample(range(1, ids.size), min(len(break_kinds), max(ids.size - 1, 0)))),
        np.int64,
    )
    why = np.array(break_kinds[: at.size], np.uint8)
    # a delivery may have signals chained after it, that came at its handler's entry
    chained = [rnd.choice((0, 0, 1, 2)) if w in DELIVERIES else 0 for w in why.tolist()]
    at = np.repeat(at, [1 + c for c in chained])
    why = np.concatenate(
        [[w, *rnd.choices(DELIVERIES, k=c)] for w, c in zip(why.tolist(), chained, strict=True)]
        or [[]]
    ).astype(np.uint8)
    start = np.array(starts, np.uint64)
    b = Blocks(
        ids=ids,
        break_at=at,
        break_kind=why,
        break_detail=np.array([rnd.randrange(1, 1 << 40) for _ in at], np.uint64),
        start=start,
        last=start + np.array(offsets, np.uint64),
        kind=np.array(kinds, np.uint8),
        size=np.array(sizes, np.uint64),
    )
    got = branches_of(b)
    want = reference_branches(b)
    assert [tuple(int(x) for x in r) for r in got] == [tuple(map(int, r)) for r in want]


faults = st.tuples(
    st.just(RecordType.FAULT),
    st.sampled_from([4, 6, 7, 8, 11]),
    st.integers(0, 1 << 62),  # time
    st.integers(0, (1 << 64) - 1),  # the instruction: any address, kernel ones too
    st.integers(0, (1 << 64) - 1),  # si_addr
    st.integers(0, 3),
    st.integers(-6, 128),
)
fars = st.tuples(st.just(RecordType.BLOCK_FAR), st.integers(0, 200), st.integers(1 << 47, 1 << 56))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(blocks, blocks, fars, faults, others), max_size=200))
def test_faults_are_placed_in_the_block_recorded_before_them(recs):
    # faults_in looks at record headers only; parse_words reads every word
    words = np.array(
        [w for r in recs for w in record_words(*[x & ((1 << 64) - 1) for x in r])], np.uint64
    )
    parsed = parse_words(words)
    is_block = np.cumsum(parsed["type"] == RecordType.BLOCK)
    want = [
        (int(is_block[i]) - 1, int(parsed["b"][i]), int(parsed["arg"][i]))
        for i in np.flatnonzero(parsed["type"] == RecordType.FAULT).tolist()
    ]
    got = [(block, f.address, f.signal) for block, f in faults_in(words)]
    assert got == want
    end = thread_end(words)
    if recs and recs[-1][0] == RecordType.FAULT:
        assert end is not None and (end.call, end.address) == ("fault", want[-1][1])


def reference_within_calls(depth: list[int], entered: list[bool]) -> list[bool]:
    """Each segment inside a call entered at an `entered` one: until one shallower."""
    inside = [False] * len(depth)
    i = 0
    while i < len(depth):
        if not entered[i]:
            i += 1
            continue
        j = i + 1
        while j < len(depth) and depth[j] >= depth[i]:
            j += 1
        inside[i:j] = [True] * (j - i)
        i = j
    return inside


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-1, 1), st.booleans()), max_size=60),
    st.lists(st.integers(0, 60), max_size=4),
)
def test_within_calls_piece_by_piece_agrees_with_the_reference(steps, cuts):
    """`calls -F` selects a history read a piece at a time: the call it is inside of
    carries over from piece to piece."""
    depth = np.cumsum([d for d, _ in steps], dtype=np.int64)
    entered = np.array([e for _, e in steps], bool)
    bounds = [0, *sorted(min(c, depth.size) for c in cuts), depth.size]
    state = np.zeros(2, np.int64)
    got = [
        within_calls_part(depth[a:b], entered[a:b], state) for a, b in itertools.pairwise(bounds)
    ]
    want = reference_within_calls(depth.tolist(), entered.tolist())
    assert np.concatenate(got).tolist() == want
    assert within_calls(depth, entered).tolist() == want
