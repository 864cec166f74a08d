"""The numba block scanner and the call-history kernel, against plain references, on
generated record streams (hypothesis)."""

from __future__ import annotations

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
    block_bounds,
    scan_blocks,
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


def reference(recs: list[tuple]) -> tuple[list[int], list[int], list[int], Counter]:
    """Block words, the break before each, and its detail (INTERRUPT: the resume address,
    GAP: the reason, LOST: the records lost since the last block), the slow way; one more
    break and detail than blocks: after the last block.  And the untraced signal handler
    runs, by the number of blocks before them."""
    words, breaks, details = [], [], []
    handlers: Counter = Counter()
    pending, detail = BREAK_NONE, 0
    for rtype, arg, *payload in recs:
        if rtype == RecordType.GAP and arg == GapReason.SIGNAL:
            handlers[len(words)] += 1  # inside a block: the thread resumes where it was
            continue
        if rtype == RecordType.BLOCK:
            words.append(payload[0] | (arg << 47))
            breaks.append(pending)
            details.append(detail if pending != BREAK_NONE else 0)
            pending = BREAK_NONE
        elif rtype == RecordType.LOST:
            detail = (detail if pending == BREAK_LOST else 0) + payload[0]
            pending = BREAK_LOST
        elif rtype == RecordType.GAP and pending != BREAK_LOST:
            pending, detail = BREAK_GAP, arg
        elif rtype == RecordType.BRANCH and arg == BranchKind.SYSCALL:
            pending, detail = BREAK_SIGRETURN, payload[0]
        elif rtype == RecordType.BRANCH:
            if pending == BREAK_SIGRETURN:
                pending = BREAK_SIGRETURN_INTERRUPT
            elif arg & INTERRUPT_AT_START:
                pending = BREAK_INTERRUPT_AT_START
            elif arg & INTERRUPT_INSIDE:
                pending = BREAK_INTERRUPT_INSIDE
            else:
                pending = BREAK_INTERRUPT
            detail = payload[0]
    breaks.append(pending)  # after the last block
    details.append(detail if pending != BREAK_NONE else 0)
    return words, breaks, details, handlers


@settings(max_examples=300, deadline=None)
@given(streams)
def test_scan_blocks_agrees_with_the_reference_parser(recs):
    words = np.array([w for r in recs for w in record_words(*r)], dtype=np.uint64)
    ids, at, why, detail, unique, handler_at, handler_times = scan_blocks(words)
    want_words, want_breaks, want_details, want_handlers = reference(recs)
    assert unique[ids].tolist() == want_words
    breaks = dense_breaks(ids.size + 1, at, why)
    assert breaks.tolist() == want_breaks
    assert at.tolist() == np.flatnonzero(breaks).tolist()  # sparse: only real breaks
    assert detail.tolist() == np.array(want_details, np.uint64)[at].tolist()
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


def reference_branches(b: Blocks) -> list[tuple[int, int, int, int]]:
    """decode.branches_of, one block pair at a time."""
    reasons = zip(b.break_kind.tolist(), b.break_detail.tolist(), strict=True)
    breaks = dict(zip(b.break_at.tolist(), reasons, strict=True))
    out = []
    for i in range(b.ids.size - 1):
        a, n = int(b.ids[i]), int(b.ids[i + 1])
        src, dst, kind = int(b.last[a]), int(b.start[n]), int(b.kind[a])
        if i + 1 in breaks:
            why, x = breaks[i + 1]
            if why == BREAK_SIGRETURN:
                out.append((x, dst, BranchKind.SYSCALL, i + 1))
            elif why == BREAK_SIGRETURN_INTERRUPT:
                out.append((src + int(b.size[a]), x, BranchKind.SYSCALL, i + 1))
                out.append((x, dst, BranchKind.INTERRUPT, i + 1))
            elif why in (BREAK_INTERRUPT, BREAK_INTERRUPT_AT_START, BREAK_INTERRUPT_INSIDE):
                # block a took its branch before the signal came: at x, where it went
                inside = int(b.start[a]) < x <= src or x == src + int(b.size[a])
                if why == BREAK_INTERRUPT_AT_START or (why == BREAK_INTERRUPT and not inside):
                    out += transfer(src, x, kind, int(b.size[a]), i + 1)
                out.append((x, dst, BranchKind.INTERRUPT, i + 1))
            continue
        out += transfer(src, dst, kind, int(b.size[a]), i + 1)
    return out


def transfer(src: int, dst: int, kind: int, size: int, block: int) -> list[tuple]:
    """The branch from a block's last instruction at src (of that kind and size) to dst,
    if it is one: not a fall-through, nor a hooked function's relocated head."""
    falls = dst == src + size
    if kind == NOT_A_BRANCH:
        if falls or 0 < dst - src <= 32:
            return []
        kind = BranchKind.INTERRUPT
    elif falls and kind == BranchKind.CONDITIONAL:
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
