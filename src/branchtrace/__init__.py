"""branchtrace: software branch tracing for native Linux x86-64 programs.

The public API a notebook user sees; everything else is internal.
"""

from typing import TYPE_CHECKING, Any

from .errors import (
    BranchtraceError,
    BusyError,
    CorruptStoreError,
    InvalidArgumentError,
    ModeConflictError,
    NoBufferError,
    NoMemoryError,
    NotSupportedError,
    OverCapError,
    StoreError,
)
from .store import (
    RECORD_DTYPE,
    BranchKind,
    Flags,
    MemoryCap,
    Mode,
    RecordType,
    Ring,
    RingReader,
    RingWriter,
    Status,
    TaskTrace,
)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .analysis import BRANCH_DTYPE, CALL_DTYPE, CallHistory, Trace, open

_ANALYSIS = {"BRANCH_DTYPE", "CALL_DTYPE", "CallHistory", "Trace", "open"}


def __getattr__(name: str) -> Any:
    # the readers pull in numba (half a second): only for those who read traces
    if name in _ANALYSIS:
        from . import analysis

        return getattr(analysis, name)
    raise AttributeError(f"module 'branchtrace' has no attribute {name!r}")


__all__ = [
    "BRANCH_DTYPE",
    "CALL_DTYPE",
    "RECORD_DTYPE",
    "BranchKind",
    "BranchtraceError",
    "BusyError",
    "CallHistory",
    "CorruptStoreError",
    "Flags",
    "InvalidArgumentError",
    "MemoryCap",
    "Mode",
    "ModeConflictError",
    "NoBufferError",
    "NoMemoryError",
    "NotSupportedError",
    "OverCapError",
    "RecordType",
    "Ring",
    "RingReader",
    "RingWriter",
    "Status",
    "StoreError",
    "TaskTrace",
    "Trace",
    "__version__",
    "open",
]
