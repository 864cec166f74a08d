"""Context switches merged into a thread's record stream, in time order."""

from __future__ import annotations

import numpy as np

from ..store import RECORD_DTYPE, RecordType, parse_words
from ..store.tracedir import TraceDir


def with_switches(records: np.ndarray, switches: np.ndarray) -> np.ndarray:
    """`records` (one thread, oldest first) with SWITCH_OUT / SWITCH_IN records inserted.

    Blocks carry no time of their own: a TIME record opens every chunk of 8192 records, so
    a switch at time t goes right before the first TIME record later than t.  Its place
    among the blocks is exact to within one chunk; its order among timed records is exact.
    SWITCH records have arg = cpu, a = time (CLOCK_MONOTONIC ns), b = 0 (no ip).
    """
    if switches.size == 0:
        return records
    timed = np.flatnonzero(records["type"] == RecordType.TIME)
    later = np.searchsorted(records["a"][timed], switches["time"], side="right")
    at = (
        np.where(later < timed.size, timed[np.minimum(later, max(timed.size - 1, 0))], records.size)
        if timed.size
        else np.full(switches.size, records.size)
    )
    new = np.zeros(switches.size, RECORD_DTYPE)
    new["type"] = np.where(switches["out"] == 1, RecordType.SWITCH_OUT, RecordType.SWITCH_IN)
    new["arg"] = switches["cpu"]
    new["a"] = switches["time"]
    end_pos = int(records["pos"][-1]) + 8 if records.size else 0
    new["pos"] = (
        np.where(at < records.size, records["pos"][np.minimum(at, records.size - 1)], end_pos)
        if records.size
        else 0
    )
    return np.insert(records, at, new)


def thread_records(trace: TraceDir, tid: int) -> np.ndarray:
    """One thread's records, oldest first, with its context switches if they were recorded."""
    words, pos = trace.words(tid)
    records = parse_words(words, pos)
    switches = trace.switches(tid)
    return records if switches is None else with_switches(records, switches)
