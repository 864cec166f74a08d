"""The store against a plain Python model of the rules in docs/format.md, in every mode."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from branchtrace import Flags, InvalidArgumentError, RingWriter, TaskTrace
from branchtrace.store import BranchKind, MemoryCap, RecordType, record_words

RING = 4096
CHUNK = 512
FLAGS = {
    "wrap": Flags.TRACE,
    "stream": Flags.TRACE | Flags.SIGNAL,
    "drop": Flags.TRACE | Flags.DROP,
}

user_addr = st.integers(1, (1 << 47) - 1)
any_addr = st.one_of(user_addr, st.integers(0xFFFF_8000_0000_0000, (1 << 64) - 1))
small = st.integers(0, (1 << 62) - 1)


class RingModel:
    """The ring's rules, written plainly: chunks claimed whole, no record across a chunk
    boundary, wrap moves the tail a chunk at a time, stream refuses, drop counts."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.head = self.claim_end = self.tail = self.clear_pos = 0
        self.records: list[tuple[int, tuple[int, int, int, int]]] = []  # (pos, parsed)
        self.lost = self.pending_lost = 0

    def _claim(self) -> bool:
        end = self.head + CHUNK
        if self.mode == "wrap":
            self.tail = max(self.tail, end - RING)
        elif end - self.tail > RING:
            return False
        self.claim_end = end
        return True

    def _reserve(self, n: int) -> bool:
        if self.head + 8 * n <= self.claim_end:
            return True
        self.head = max(self.head, self.claim_end)  # pad
        return self._claim()

    def _store(self, n: int, parsed: tuple[int, int, int, int]) -> None:
        self.records.append((self.head, parsed))
        self.head += 8 * n

    def write(self, n: int, parsed: tuple[int, int, int, int]) -> str:
        """'ok', 'lost' (drop) or 'full' (stream: the writer would wait)."""
        if self.pending_lost:
            if not self._reserve(2 + n):
                self.lost += 1
                self.pending_lost += 1
                return "lost"
            self._store(2, (RecordType.LOST, 0, self.pending_lost, 0))
            self.pending_lost = 0
        if not self._reserve(n):
            if self.mode == "stream":
                return "full"
            self.lost += 1
            self.pending_lost += 1
            return "lost"
        self._store(n, parsed)
        return "ok"

    def valid(self) -> list[tuple[int, int, int, int]]:
        start = max(self.tail, self.clear_pos)
        return [p for pos, p in self.records if pos >= start]

    def release(self) -> None:
        if self.mode == "wrap":
            self.clear_pos = max(self.clear_pos, self.head)
        else:
            self.tail = max(self.tail, self.head)


def as_tuples(records: np.ndarray) -> list[tuple[int, int, int, int]]:
    return [(int(r["type"]), int(r["arg"]), int(r["a"]), int(r["b"])) for r in records]


class StoreMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from(sorted(FLAGS)))
    def setup(self, mode: str) -> None:
        # the stream writer signals the ring's consumer (this process, once drain has
        # consumed) when the ring is full: SIGIO, whose default action kills the process
        self.old_sigio = signal.signal(signal.SIGIO, lambda *_: None)
        self.dir = Path(tempfile.mkdtemp(prefix="bt-model-", dir="/dev/shm"))
        self.task = TaskTrace(self.dir / "t.bts", cap=MemoryCap(1 << 30))
        self.task.config(RING, FLAGS[mode])
        self.writer = RingWriter(self.task.ring, stall_timeout=0.0)
        self.model = RingModel(mode)
        self.next_block = 1

    def teardown(self) -> None:
        if hasattr(self, "task"):
            self.writer.close()
            self.task.close()
            shutil.rmtree(self.dir)
            signal.signal(signal.SIGIO, self.old_sigio)

    def _write(self, rtype: int, arg: int, payload: list[int], parsed: tuple) -> None:
        words = record_words(rtype, arg, *payload)
        expect = self.model.write(len(words), parsed)
        if expect == "full":
            try:
                self.writer.write_words(words)
            except TimeoutError:
                return
            raise AssertionError("stream writer placed a record in a full ring")
        assert self.writer.write_words(words) == (expect == "ok")

    @rule(start=user_addr, off=st.integers(0, 0xFFFF))
    def write_block(self, start: int, off: int) -> None:
        self._write(RecordType.BLOCK, off, [start], (RecordType.BLOCK, off, start, start + off))

    @rule(start=st.integers(1 << 47, (1 << 62) - 1), off=st.integers(0, 0xFFFF))
    def write_far_block(self, start: int, off: int) -> None:
        self._write(RecordType.BLOCK, off, [start], (RecordType.BLOCK, off, start, start + off))

    @rule(kind=st.sampled_from(list(BranchKind)), src=any_addr, dst=any_addr)
    def write_branch(self, kind: BranchKind, src: int, dst: int) -> None:
        self._write(RecordType.BRANCH, kind, [src, dst], (RecordType.BRANCH, kind, src, dst))

    @rule(probe=st.integers(0, 1000), t=small, ip=user_addr, nvalues=st.integers(0, 60))
    def write_probe_hit(self, probe: int, t: int, ip: int, nvalues: int) -> None:
        payload = [t, ip, *range(nvalues)]
        self._write(RecordType.PROBE_HIT, probe, payload, (RecordType.PROBE_HIT, probe, t, ip))

    @rule(cpu=st.integers(0, 255), t=small, ip=any_addr, out=st.booleans())
    def write_switch(self, cpu: int, t: int, ip: int, out: bool) -> None:
        rtype = RecordType.SWITCH_OUT if out else RecordType.SWITCH_IN
        self._write(rtype, cpu, [t, ip], (rtype, cpu, t, ip))

    @precondition(lambda self: self.model.mode != "stream")
    @rule(n=st.integers(1, 700))
    def write_blocks_bulk(self, n: int) -> None:
        starts = np.arange(self.next_block, self.next_block + n, dtype=np.uint64)
        self.next_block += n
        for s in starts.tolist():
            self.model.write(1, (RecordType.BLOCK, 0, s, s))
        self.writer.write_blocks(starts)

    @rule()
    def drain(self) -> None:
        assert as_tuples(self.task.drain()) == self.model.valid()
        self.model.release()

    @rule()
    def clear(self) -> None:
        self.task.clear()
        self.model.release()

    @rule()
    def size(self) -> None:
        assert self.task.size() == len(self.model.valid())

    @rule(i=st.integers(-2, 700))
    def get(self, i: int) -> None:
        valid = self.model.valid()
        if 0 <= i < len(valid):
            assert as_tuples(self.task.get(i)[None]) == [valid[-1 - i]]
        else:
            try:
                self.task.get(i)
            except InvalidArgumentError:
                return
            raise AssertionError(f"get({i}) of {len(valid)} records did not fail")

    @invariant()
    def counters(self) -> None:
        if hasattr(self, "task"):
            assert self.task.status().lost_records == self.model.lost


StoreMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestStore = StoreMachine.TestCase
