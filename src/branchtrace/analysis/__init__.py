"""Pure functions over recorded records: decoding, call history, stats.  No engines, no
privileges."""

from .decode import BRANCH_DTYPE, Blocks, branches_of, scan
from .timeline import thread_records, with_switches
from .trace import (
    BREAK_DTYPE,
    CALL_DTYPE,
    CallHistory,
    ThreadEnd,
    Trace,
    describe_break,
    open,
    signal_name,
)

__all__ = [
    "BRANCH_DTYPE",
    "BREAK_DTYPE",
    "CALL_DTYPE",
    "Blocks",
    "CallHistory",
    "ThreadEnd",
    "Trace",
    "branches_of",
    "describe_break",
    "open",
    "scan",
    "signal_name",
    "thread_records",
    "with_switches",
]
