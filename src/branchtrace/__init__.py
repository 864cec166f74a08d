"""branchtrace: software branch tracing for native Linux x86-64 programs.

The public API a notebook user sees; everything else is internal.
"""

from .analysis import BRANCH_DTYPE, CALL_DTYPE, CallHistory, Trace, open
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
