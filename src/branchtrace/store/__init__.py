"""The Branch Trace Store: the record format, the shared ring and the seed's BTS API."""

from .bts import DEFAULT_CAP, MemoryCap, Status, TaskTrace, parse_size
from .format import (
    HEADER_DTYPE,
    RECORD_DTYPE,
    BranchKind,
    FaultAccess,
    Flags,
    Mode,
    RecordType,
    c_definitions,
    record_words,
)
from .records import MetaEntry, parse_meta, parse_words
from .ring import Ring, RingReader, RingWriter, recovered_head

__all__ = [
    "DEFAULT_CAP",
    "HEADER_DTYPE",
    "RECORD_DTYPE",
    "BranchKind",
    "FaultAccess",
    "Flags",
    "MemoryCap",
    "MetaEntry",
    "Mode",
    "RecordType",
    "Ring",
    "RingReader",
    "RingWriter",
    "Status",
    "TaskTrace",
    "c_definitions",
    "parse_meta",
    "parse_size",
    "parse_words",
    "record_words",
    "recovered_head",
]
