"""Turn raw ring words into parsed records, with numpy doing the work.

Record boundaries are found without a Python loop: every word with bit 63 set is an
escape header (payload words never have it), so headers, their payload spans and the
one-word BLOCK records fall out of a few vectorised passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import CorruptStoreError
from .format import (
    ARG_MASK,
    BLOCK_ADDR_BITS,
    BLOCK_ADDR_MASK,
    ESCAPE_BIT,
    LEN_MASK,
    LEN_SHIFT,
    MAX_RING_PAYLOAD,
    META_FIXED_WORDS,
    RECORD_DTYPE,
    RING_TYPES,
    TYPE_MASK,
    TYPE_SHIFT,
    WORD,
    RecordType,
    unpayload,
)

_U64 = np.uint64
_ADDRESS_A = np.array(
    [t in (RecordType.BRANCH, RecordType.BLOCK_FAR) for t in range(128)], dtype=bool
)
_ADDRESS_B = np.array(
    [
        t
        in (
            RecordType.BRANCH,
            RecordType.SWITCH_OUT,
            RecordType.SWITCH_IN,
            RecordType.PROBE_HIT,
            RecordType.THREAD_EXIT,
            RecordType.FAULT,
        )
        for t in range(128)
    ],
    dtype=bool,
)
_VALID_ESCAPE = np.array(
    [t in RING_TYPES and t != RecordType.BLOCK for t in range(128)], dtype=bool
)


def _fill_blocks(out: np.ndarray, words: np.ndarray) -> None:
    start = words & _U64(BLOCK_ADDR_MASK)
    off = words >> _U64(BLOCK_ADDR_BITS)
    out["type"] = RecordType.BLOCK
    out["arg"] = off
    out["a"] = start
    out["b"] = start + off


def _payload_words(first: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices of the payload words of records whose payloads begin at `first` and are
    `lengths` words long, in order."""
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    run_starts = np.cumsum(lengths) - lengths
    return np.repeat(first - run_starts, lengths) + np.arange(total, dtype=np.int64)


def parse_words(words: np.ndarray, start_pos: int = 0, *, where: str = "ring") -> np.ndarray:
    """Parse whole records from `words` (which must start on a record boundary).

    Returns an array of RECORD_DTYPE, oldest first, PAD records removed.  `start_pos` is
    the stream position (bytes) of words[0].  BLOCK_FAR records come back as BLOCK.
    Raises CorruptStoreError (naming `where`) on a zero word, an unknown type, a header
    inside another record's payload, or a record cut off at the end.
    """
    w = np.ascontiguousarray(words, dtype=_U64)
    n = w.size
    escape = (w >> _U64(63)).astype(bool)
    hidx = np.flatnonzero(escape)
    hw = w[hidx]
    htype = ((hw >> _U64(TYPE_SHIFT)) & _U64(TYPE_MASK)).astype(np.uint8)
    hlen = ((hw >> _U64(LEN_SHIFT)) & _U64(LEN_MASK)).astype(np.int64)
    ends = hidx + 1 + hlen
    if hidx.size:
        bad = ~_VALID_ESCAPE[htype] | (hlen > MAX_RING_PAYLOAD)
        if bad.any():
            i = int(hidx[np.argmax(bad)])
            raise CorruptStoreError(
                f"{where}: bad record header {int(w[i]):#018x} at position {start_pos + i * WORD}"
            )
        if ends[-1] > n:
            raise CorruptStoreError(
                f"{where}: record at position {start_pos + int(hidx[-1]) * WORD} is cut off"
            )
        if hidx.size > 1 and (hidx[1:] < ends[:-1]).any():
            i = int(hidx[1:][np.argmax(hidx[1:] < ends[:-1])])
            raise CorruptStoreError(
                f"{where}: record header inside a payload at position {start_pos + i * WORD}"
            )
    # Escapes are rare: the masks and scatters below touch their few words, and each
    # full-length pass is one the commonest words (BLOCK) need anyway.
    with_payload = hlen > 0
    payload = _payload_words(hidx[with_payload] + 1, hlen[with_payload])
    zero = np.flatnonzero(w == 0)
    if zero.size:
        loose = zero[~np.isin(zero, payload, assume_unique=True)]
        if loose.size:
            raise CorruptStoreError(
                f"{where}: empty word at position {start_pos + int(loose[0]) * WORD}"
            )
    pad = hidx[htype == RecordType.PAD]
    if payload.size or pad.size:
        keep = np.ones(n, dtype=bool)
        keep[payload] = False
        keep[pad] = False
        rec_idx = np.flatnonzero(keep)
        head = w[rec_idx]
    else:
        rec_idx = np.arange(n, dtype=np.int64)
        head = w
    out = np.empty(rec_idx.size, dtype=RECORD_DTYPE)
    out["pos"] = rec_idx.astype(_U64) * _U64(WORD) + _U64(start_pos)
    _fill_blocks(out, head)
    esc = hidx[htype != RecordType.PAD]
    if esc.size == 0:
        return out
    rows = np.searchsorted(rec_idx, esc)
    eh = w[esc]
    t = ((eh >> _U64(TYPE_SHIFT)) & _U64(TYPE_MASK)).astype(np.uint8)
    ln = (eh >> _U64(LEN_SHIFT)) & _U64(LEN_MASK)
    last = n - 1  # (a word past a header is read only where its payload has it)
    p0 = np.where(ln >= 1, w[np.minimum(esc + 1, last)], _U64(0))
    p1 = np.where(ln >= 2, w[np.minimum(esc + 2, last)], _U64(0))
    p0 = np.where(_ADDRESS_A[t], unpayload(p0), p0)
    p1 = np.where(_ADDRESS_B[t], unpayload(p1), p1)
    arg = eh & _U64(ARG_MASK)
    far = t == RecordType.BLOCK_FAR
    out["type"][rows] = np.where(far, np.uint8(RecordType.BLOCK), t)
    out["arg"][rows] = arg
    out["a"][rows] = p0
    out["b"][rows] = np.where(far, p0 + arg, p1)
    return out


@dataclass(frozen=True)
class MetaEntry:
    """One metadata-log entry: a module load, a thread name...

    `pos` is the ring stream position when it was written: records before `pos` were
    written before the event.  `fixed` holds the type's fixed fields (see
    format.META_FIXED_WORDS); `data` its variable bytes.
    """

    type: RecordType
    pos: int
    time_ns: int
    fixed: tuple[int, ...]
    data: bytes

    @property
    def path(self) -> str:
        """The path of a MODULE_LOAD or PROCESS entry."""
        raw = self.data[1 + self.data[0] :] if self.type == RecordType.MODULE_LOAD else self.data
        return raw.decode("utf-8", "surrogateescape")

    @property
    def build_id(self) -> bytes:
        """The GNU build-id of a MODULE_LOAD entry (empty if the module had none)."""
        return self.data[1 : 1 + self.data[0]] if self.data else b""


def parse_meta(buf: bytes | memoryview, where: str = "metadata") -> list[MetaEntry]:
    """Parse the metadata log; entries are rare, so a plain loop is right here."""
    entries: list[MetaEntry] = []
    mv = memoryview(buf)
    off = 0
    while off < len(mv):
        if len(mv) - off < 3 * WORD:
            raise CorruptStoreError(f"{where}: entry cut off at offset {off}")
        head, pos, time_ns = np.frombuffer(mv[off : off + 3 * WORD], dtype="<u8").tolist()
        rtype = (head >> TYPE_SHIFT) & TYPE_MASK
        nwords = (head >> LEN_SHIFT) & LEN_MASK
        nbytes = head & ARG_MASK
        if not head >> 63 or rtype not in META_FIXED_WORDS:
            raise CorruptStoreError(f"{where}: bad entry header {head:#018x} at offset {off}")
        kind = RecordType(rtype)
        nfixed = META_FIXED_WORDS[kind]
        end = off + (1 + nwords) * WORD
        data_off = off + (3 + nfixed) * WORD
        if end > len(mv) or data_off + nbytes > end:
            raise CorruptStoreError(f"{where}: entry at offset {off} is cut off")
        fixed = tuple(np.frombuffer(mv[off + 3 * WORD : data_off], dtype="<u8").tolist())
        entries.append(
            MetaEntry(kind, pos, time_ns, fixed, bytes(mv[data_off : data_off + nbytes]))
        )
        off = end
    return entries


def count_records(words: np.ndarray, *, slots: bool = False) -> tuple[int, dict[int, int]]:
    """How many records (PAD excluded) `words` holds, and how many GAP records of each
    reason, without building them.  `slots`: the words come from a ring with a block table
    (two block ids to a word; a word's high slot may be empty)."""
    w = np.ascontiguousarray(words, dtype=_U64)
    hidx = np.flatnonzero(w >= ESCAPE_BIT)
    # with slots: every taken slot is a non-zero half; escape records' halves are taken
    # back below (counting halves in place is 2x faster than splitting the words)
    total = int(np.count_nonzero(w.view(np.uint32))) if slots else w.size
    if not hidx.size:  # the usual case: nothing but blocks
        return total, {}
    headers = w[hidx]
    types = (headers >> _U64(TYPE_SHIFT)) & _U64(TYPE_MASK)
    lengths = ((headers >> _U64(LEN_SHIFT)) & _U64(LEN_MASK)).astype(np.int64)
    if slots:
        inside = np.concatenate([hidx, _payload_index(hidx, lengths, w.size)])
        total += hidx.size - int(np.count_nonzero(w[inside].view(np.uint32)))
    else:
        total -= int(lengths.sum())
    pads = int(np.count_nonzero(types == RecordType.PAD))
    gaps: dict[int, int] = {}
    for reason in headers[types == RecordType.GAP] & _U64(ARG_MASK):
        gaps[int(reason)] = gaps.get(int(reason), 0) + 1
    return total - pads, gaps


def _payload_index(hidx: np.ndarray, lengths: np.ndarray, n: int) -> np.ndarray:
    """Indexes of the payload words of the headers at `hidx` (cut at `n`)."""
    first = np.repeat(hidx + 1 - np.cumsum(lengths) + lengths, lengths)
    at = first + np.arange(first.size)
    return at[at < n]


def expand_slots(
    words: np.ndarray | Sequence[np.ndarray], table: np.ndarray, *, where: str = "ring"
) -> np.ndarray:
    """The words of a ring with a block table, with each slot's block id replaced by the
    table's BLOCK word for it (empty slots dropped) and each BLOCK_FAR record that fits a
    BLOCK word made one (what the writer records once its table is full), so that they
    read like any ring's.  `words` (or each of a sequence of arrays, expanded one after
    the other into one result) must start on a record boundary.  Raises CorruptStoreError
    on an id outside the table or a word with an empty low slot."""
    from ._expand import expand

    entries = np.concatenate([np.zeros(1, _U64), table[1:]]) if table.size else np.zeros(1, _U64)
    if (entries[1:] == 0).any():
        raise CorruptStoreError(f"{where}: the block table has an empty entry")
    arrays = [
        np.ascontiguousarray(w, dtype=_U64)
        for w in ([words] if isinstance(words, np.ndarray) else words)
    ]
    # allocated once, at most two records a word: on this VM fresh pages cost more than
    # the expanding, and pages never written are never faulted in
    out = np.empty(2 * sum(w.size for w in arrays), _U64)
    at = 0
    for w in arrays:
        end = expand(w, entries, out, at)
        if end < 0:
            i = -1 - end
            raise CorruptStoreError(
                f"{where}: word {int(w[i]):#018x} at index {i} holds no block id of the "
                f"{entries.size - 1}-entry block table"
            )
        at = end
    return out[:at]
