"""The one definition of the store's on-disk layout and record encoding.

`docs/format.md` describes it in prose; the numpy dtypes and constants here are the
definition.  The C writer gets the same numbers from :func:`c_definitions`, so the two can
never disagree silently (the tests compile it and compare).

A store file is three areas::

    [ header page | ring data area (2^k bytes) | metadata log ]

The ring is an array of little-endian 64-bit words.  A record is one word, or an escape
header word followed by payload words:

* bit 63 clear: a BLOCK record.  Bits 0-46 are the start address of an executed block of
  code, bits 47-62 the offset of the block's last instruction from that start.  This is
  what the in-process writer emits once per executed block (8 bytes per block).
* in a ring with a block table (``table_size`` > 0, what the stalker engine's inline
  writer uses), a word that is neither an escape header nor payload holds two 32-bit
  *slots* instead, low half first: each a block id (an index into the table, whose entry
  is that block's BLOCK word) or 0, empty.  4 bytes per executed block; readers expand
  slots into BLOCK words (:func:`records.expand_slots`) before anything else sees them.
* bit 63 set: an escape header (the seed's escape addresses, generalised).  Bits 56-62
  are the record type, bits 40-55 the number of payload words that follow, bits 0-39 an
  argument.  Payload words in the ring always have bit 63 clear, so every word with bit
  63 set is a header and a reader finds record boundaries with vectorised numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum, IntFlag

import numpy as np

MAGIC = b"BTSTORE\x00"
#: 2: an inline writer may skip zeroing chunks and publish its write pointer instead
#: (inline_ptr, inline_base); version 1 rings read the same with those fields zero.
#: 3: a ring may have a block table, and then holds 4-byte block ids (table_*).
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
HEADER_SIZE = 4096
WORD = 8

#: smallest ring data area, bytes; sizes are powers of two
MIN_DATA_SIZE = 4096
#: largest chunk; a chunk is the unit in which the writer claims space (see docs/format.md)
MAX_CHUNK_SIZE = 64 * 1024
#: ring records carry at most this many payload words (so padding never exceeds it)
MAX_RING_PAYLOAD = 62
#: default size of the metadata log, bytes
DEFAULT_META_SIZE = 1 << 20

ESCAPE_BIT = np.uint64(1 << 63)
BLOCK_ADDR_BITS = 47
BLOCK_ADDR_MASK = (1 << BLOCK_ADDR_BITS) - 1
BLOCK_OFF_BITS = 16
BLOCK_OFF_MASK = (1 << BLOCK_OFF_BITS) - 1
TYPE_SHIFT = 56
TYPE_MASK = 0x7F
LEN_SHIFT = 40
LEN_MASK = 0xFFFF
ARG_MASK = (1 << 40) - 1
PAYLOAD_MASK = (1 << 63) - 1
#: block ids fill 32-bit slots, and the high slot of a word must leave bit 63 clear
MAX_BLOCK_ID = (1 << 31) - 1


class RecordType(IntEnum):
    """Record kinds.  Values are the escape header's type field (BLOCK has no header)."""

    PAD = 0  #: one word, fills the end of a chunk; never returned by readers
    BLOCK = 1  #: executed block: a=start, b=address of its last instruction, arg=offset
    BRANCH = 2  #: taken control transfer: arg=BranchKind, a=from, b=to
    BLOCK_FAR = 3  #: BLOCK whose start does not fit in 47 bits: arg=offset, a=start
    SWITCH_OUT = 4  #: task departs (seed MAGIC1): arg=cpu, a=time_ns, b=ip
    SWITCH_IN = 5  #: task arrives (seed MAGIC2): arg=cpu, a=time_ns, b=ip
    THREAD_START = 6  #: arg=tid, a=time_ns
    #: arg=tid, a=time_ns, b=ip of the exit system call (0: unknown); more payload: the
    #: call's argument (the status) and its number (60 exit, 231 exit_group; 59 execve and
    #: 322 execveat end the image only if nothing follows: an exec that fails returns)
    THREAD_EXIT = 7
    LOST = 8  #: records were dropped here: a=count
    PROBE_HIT = 9  #: arg=probe id, a=time_ns, b=ip, more payload words = fetched values
    TIME = 10  #: a=time_ns, a clock reading for correlating rings
    GAP = 11  #: the thread ran untraced code here (arg=GapReason): no branch spans a gap
    #: the thread took a fault: arg=signal, a=time_ns, b=ip of the instruction it had not
    #: finished (0: not known); more payload: the faulting memory address (si_addr), the
    #: access (FaultAccess) and the signal's si_code
    FAULT = 12
    # metadata log only; payload words may be any bytes there
    MODULE_LOAD = 32  #: payload: pos, time_ns, base, size, build-id, path
    MODULE_UNLOAD = 33  #: payload: pos, time_ns, base
    THREAD_NAME = 34  #: payload: pos, time_ns, tid, name
    PROCESS = 35  #: payload: pos, time_ns, pid, executable path


RING_TYPES = frozenset(t for t in RecordType if t < 32)
META_TYPES = frozenset(t for t in RecordType if t >= 32)


class FaultAccess(IntEnum):
    """What a FAULT's instruction did to its memory address, when the CPU says."""

    UNKNOWN = 0
    READ = 1
    WRITE = 2
    EXECUTE = 3


class BranchKind(IntEnum):
    """What kind of control transfer a branch is."""

    CALL = 1
    RETURN = 2
    JUMP = 3
    CONDITIONAL = 4
    INDIRECT_CALL = 5
    INDIRECT_JUMP = 6
    SYSCALL = 7
    INTERRUPT = 8  #: asynchronous: signal delivery, exception


#: Where the stalker engine's INTERRUPT branch records say a signal came (bits of the
#: record's argument above the kind): at the first instruction of a block whose record
#: follows (the block recorded before took its branch there first), or inside the block
#: recorded before (the rest of it runs after the handler).  Neither (the step engine):
#: readers place it by the addresses.
INTERRUPT_AT_START = 0x100
INTERRUPT_INSIDE = 0x200


class GapReason(IntEnum):
    FORK = 1  #: fork() runs untraced (Frida Stalker cannot follow a thread through it)
    SIGNAL = 2  #: a signal handler ran natively, untraced (not sent into Stalker's copy)
    #: a signal handler left by a jump (siglongjmp), or returned to a pc it moved, rather
    #: than to where the signal came: the thread is traced again from there, and no branch
    #: spans the gap
    LEFT_HANDLER = 3


class Mode(IntEnum):
    """Overflow policy of a ring."""

    WRAP = 0  #: newest records overwrite the oldest (debugging: keep the tail)
    STREAM = 1  #: the writer waits for the consumer: nothing is ever lost
    DROP = 2  #: the writer never waits; every dropped record is counted


class Flags(IntFlag):
    """The seed's PTRACE_BTS_O_* flags, plus DROP."""

    NONE = 0
    TRACE = 1  #: branch tracing on
    SCHED = 2  #: context-switch records
    SIGNAL = 4  #: stream: on a full buffer notify the consumer and wait instead of wrapping
    CUT_SIZE = 8  #: clamp a too-large size to the maximum allowed instead of failing
    DROP = 16  #: with SIGNAL: never wait; drop and count records on a full buffer


class WriterState(IntEnum):
    NONE = 0
    ACTIVE = 1
    CLOSED = 2  #: the writer closed the ring cleanly; data_head is exact


def _cacheline(offset: int) -> int:
    assert offset % 64 == 0
    return offset


#: The header page.  Fields written by the writer and by the consumer sit on separate
#: cache lines so the two sides do not false-share.
# fmt: off
HEADER_DTYPE = np.dtype(
    {
        "names": [
            "magic", "version", "header_size", "data_offset", "data_size", "chunk_size",
            "meta_offset", "meta_size", "mode", "flags", "writer_pid", "tid",
            "notify_signal", "consumer_pid", "created_ns", "writer_state",
            "data_head", "head_seq", "reader_waiting", "claim_end",
            "data_tail", "tail_seq", "writer_waiting", "clear_pos",
            "lost_records", "lost_events", "writer_waits", "meta_head", "meta_lost",
            "inline_ptr", "inline_base", "table_offset", "table_size", "table_count",
            "table_spilled", "counted_records", "counted_gap_fork", "counted_gap_signal",
            "counted_gap_left_handler", "counted_signals_held", "counted_signals_merged",
            "counted_to",
        ],
        "formats": [
            "S8", "<u4", "<u4", "<u8", "<u8", "<u8",
            "<u8", "<u8", "<u4", "<u4", "<u4", "<u4",
            "<u4", "<u4", "<u8", "<u4",
            "<u8", "<u4", "<u4", "<u8",
            "<u8", "<u4", "<u4", "<u8",
            "<u8", "<u8", "<u8", "<u8", "<u8",
            "<u8", "<u8", "<u8", "<u8", "<u8",
            "<u8", "<u8", "<u8", "<u8",
            "<u8", "<u8", "<u8",
            "<u8",
        ],
        "offsets": [
            0, 8, 12, 16, 24, 32,
            40, 48, 56, 60, 64, 68,
            72, 76, 80, 88,
            _cacheline(128), 136, 140, 144,
            _cacheline(192), 200, 204, 208,
            _cacheline(256), 264, 272, 280, 288,
            _cacheline(320), 328, 336, 344, 352,
            360, 368, 376, 384,
            392, 400, 408,
            416,
        ],
        "itemsize": HEADER_SIZE,
    }
)
# fmt: on

#: A parsed ring record.  `pos` is the record's byte position in the ring's stream (the
#: coordinate of data_head and data_tail): strictly increasing, never reused.
RECORD_DTYPE = np.dtype(
    {
        "names": ["type", "arg", "a", "b", "pos"],
        "formats": ["u1", "<u8", "<u8", "<u8", "<u8"],
        "offsets": [0, 8, 16, 24, 32],
        "itemsize": 40,
    }
)


def escape(rtype: int, nwords: int, arg: int = 0) -> int:
    """The header word of an escape record with `nwords` payload words."""
    if not 0 <= arg <= ARG_MASK:
        raise ValueError(f"escape argument {arg:#x} does not fit in 40 bits")
    return (1 << 63) | (rtype << TYPE_SHIFT) | (nwords << LEN_SHIFT) | arg


def block_word(start: int, last_off: int = 0) -> int:
    """The one-word BLOCK record; raises ValueError if it needs the BLOCK_FAR form."""
    if not 0 < start <= BLOCK_ADDR_MASK or not 0 <= last_off <= BLOCK_OFF_MASK:
        raise ValueError("block start or offset out of range for a BLOCK word")
    return start | (last_off << BLOCK_ADDR_BITS)


def payload_word(value: int) -> int:
    """A ring payload word: bit 63 cleared.  Canonical x86-64 addresses survive, because
    bits 47-63 are equal: the reader sign-extends bit 62 (see :func:`unpayload`)."""
    return value & PAYLOAD_MASK


def unpayload(words: np.ndarray) -> np.ndarray:
    """Undo :func:`payload_word`: copy bit 62 into bit 63."""
    w = words.astype(np.uint64, copy=False)
    return w | ((w << np.uint64(1)) & ESCAPE_BIT)


def record_words(rtype: int, arg: int = 0, *payload: int) -> list[int]:
    """Encode one ring record as words (the Python writer's and the tests' encoder)."""
    if rtype == RecordType.BLOCK:
        start, *rest = payload
        off = arg
        if 0 < start <= BLOCK_ADDR_MASK and off <= BLOCK_OFF_MASK:
            return [block_word(start, off)]
        return [escape(RecordType.BLOCK_FAR, 1, off), payload_word(start), *rest]
    if rtype not in RING_TYPES or rtype == RecordType.PAD:
        raise ValueError(f"record type {rtype} cannot be written to a ring")
    if len(payload) > MAX_RING_PAYLOAD:
        raise ValueError(f"at most {MAX_RING_PAYLOAD} payload words per record")
    return [escape(rtype, len(payload), arg), *(payload_word(p) for p in payload)]


#: PROBE_HIT value tags in the packed value bytes
VALUE_NONE, VALUE_INT, VALUE_STR = 0, 1, 2
#: payload words of a PROBE_HIT before its packed values: time_ns, ip, value byte count
PROBE_HIT_FIXED = 3


def pack_bytes(data: bytes) -> list[int]:
    """Bytes as payload words, 7 to a word (bit 63 stays clear)."""
    padded = data + b"\0" * (-len(data) % 7)
    return [int.from_bytes(padded[i : i + 7], "little") for i in range(0, len(padded), 7)]


def unpack_bytes(words: Sequence[int], n: int) -> bytes:
    return b"".join(int(w).to_bytes(8, "little")[:7] for w in words)[:n]


def probe_hit_payload(time_ns: int, ip: int, values: Sequence[int | str | None]) -> list[int]:
    """A PROBE_HIT record's payload: time, ip, then the fetched values packed as bytes
    (per value: a tag byte; an int as 8 bytes two's complement; a string as a 2-byte
    length and UTF-8).  Strings are cut so the record fits in a ring record."""
    room = (MAX_RING_PAYLOAD - PROBE_HIT_FIXED) * 7
    blob = _pack_values(values)
    while len(blob) > room:  # cut the longest string by what is too much
        strings = [v for v in values if isinstance(v, str)]
        if not strings:
            raise ValueError(f"probe values take {len(blob)} bytes, a record holds {room}")
        longest = max(strings, key=len)
        cut = longest[: max(0, len(longest) - (len(blob) - room) - 1)]
        values = [cut if v is longest else v for v in values]
        blob = _pack_values(values)
    return [time_ns, ip, len(blob), *pack_bytes(bytes(blob))]


def _pack_values(values: Sequence[int | str | None]) -> bytearray:
    blob = bytearray()
    for v in values:
        if v is None:
            blob.append(VALUE_NONE)
        elif isinstance(v, int):
            blob.append(VALUE_INT)
            blob += (v & (2**64 - 1)).to_bytes(8, "little")
        else:
            blob.append(VALUE_STR)
            raw = v.encode("utf-8", "surrogateescape")
            blob += b"\0\0"
            at = len(blob)
            blob += raw
            blob[at - 2 : at] = len(raw).to_bytes(2, "little")
    return blob


def parse_probe_hit(payload: Sequence[int]) -> tuple[int, int, list[int | str | None]]:
    """(time_ns, ip, values) of a PROBE_HIT payload; ints come back signed."""
    time_ns, ip, n = (int(w) for w in payload[:PROBE_HIT_FIXED])
    blob = unpack_bytes(payload[PROBE_HIT_FIXED:], n)
    values: list[int | str | None] = []
    i = 0
    while i < len(blob):
        tag = blob[i]
        i += 1
        if tag == VALUE_INT:
            values.append(int.from_bytes(blob[i : i + 8], "little", signed=True))
            i += 8
        elif tag == VALUE_STR:
            k = int.from_bytes(blob[i : i + 2], "little")
            values.append(blob[i + 2 : i + 2 + k].decode("utf-8", "surrogateescape"))
            i += 2 + k
        else:
            values.append(None)
    return time_ns, ip, values


def c_writer_source() -> str:
    """The generated definitions followed by the C writer (`bt_writer.h`), ready to include
    once the includer has defined stdint types and the bt_futex_wait, bt_futex_wake and
    bt_notify hooks (see the header's comment)."""
    from pathlib import Path

    return c_definitions() + Path(__file__).with_name("bt_writer.h").read_text()


def c_definitions() -> str:
    """C preprocessor definitions of the layout, generated from this module."""
    lines = [
        "/* Generated by branchtrace.store.format.c_definitions(): do not edit. */",
        f"#define BT_VERSION {VERSION}",
        f"#define BT_HEADER_SIZE {HEADER_SIZE}",
        f"#define BT_MAX_RING_PAYLOAD {MAX_RING_PAYLOAD}",
        f"#define BT_BLOCK_ADDR_BITS {BLOCK_ADDR_BITS}",
        f"#define BT_TYPE_SHIFT {TYPE_SHIFT}",
        f"#define BT_LEN_SHIFT {LEN_SHIFT}",
        "#define BT_PAYLOAD_MASK 0x7fffffffffffffffULL",
        "#define BT_ESCAPE_BIT 0x8000000000000000ULL",
    ]
    magic = int.from_bytes(MAGIC, "little")
    lines.append(f"#define BT_MAGIC {magic:#x}ULL")
    for e in (RecordType, Mode, WriterState, GapReason):
        for m in e:
            lines.append(f"#define BT_{e.__name__.upper()}_{m.name} {int(m)}")
    for f in Flags:
        lines.append(f"#define BT_FLAG_{f.name} {int(f)}")
    for k in BranchKind:
        lines.append(f"#define BT_KIND_{k.name} {int(k)}")
    lines.append(f"#define BT_INTERRUPT_AT_START {INTERRUPT_AT_START:#x}")
    lines.append(f"#define BT_INTERRUPT_INSIDE {INTERRUPT_INSIDE:#x}")
    fields = HEADER_DTYPE.fields
    assert fields is not None
    for name, spec in fields.items():
        dt, off = spec[0], spec[1]
        lines.append(f"#define BT_OFF_{name.upper()} {off}")
        lines.append(f"#define BT_SIZE_{name.upper()} {dt.itemsize}")
    return "\n".join(lines) + "\n"


#: number of fixed 64-bit fields after (pos, time_ns) in each metadata entry; the rest of
#: the entry is `arg` bytes of data (a path, a name), padded to whole words
META_FIXED_WORDS = {
    RecordType.MODULE_LOAD: 2,  # base, size; data: build-id length byte, build-id, path
    RecordType.MODULE_UNLOAD: 1,  # base
    RecordType.THREAD_NAME: 1,  # tid; data: name
    RecordType.PROCESS: 1,  # pid; data: executable path
}


def meta_entry(rtype: RecordType, pos: int, time_ns: int, fixed: list[int], data: bytes) -> bytes:
    """Encode one metadata-log entry."""
    if len(fixed) != META_FIXED_WORDS[rtype]:
        raise ValueError(f"{rtype.name} takes {META_FIXED_WORDS[rtype]} fixed fields")
    padded = data + b"\0" * (-len(data) % WORD)
    nwords = 2 + len(fixed) + len(padded) // WORD
    words = [escape(rtype, nwords, len(data)), pos, time_ns, *fixed]
    return b"".join(w.to_bytes(8, "little") for w in words) + padded
