"""A recording, read: `branchtrace.open(DIR)` returns a `Trace`.

>>> trace = branchtrace.open("branchtrace.data")
>>> tid = trace.threads[0]
>>> trace.branches(tid)          # numpy: from, to, kind, block
>>> trace.calls(tid).functions() # the function-call history, oldest first
>>> trace.stats()                # {"functions": {name: calls}, "threads": {...}}
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import InvalidArgumentError
from ..store.format import (
    ARG_MASK,
    LEN_MASK,
    LEN_SHIFT,
    TYPE_MASK,
    TYPE_SHIFT,
    FaultAccess,
    GapReason,
    RecordType,
    unpayload,
)
from ..store.tracedir import TraceDir, thread_label
from ..symbols import ModuleMap
from .decode import Blocks, DistinctBlocks, blocks_of, branches_of
from .kernels import (
    BREAK_GAP,
    BREAK_LOST,
    BREAK_SIGRETURN,
    HOW_CALL,
    HOW_TAIL,
    SIGNAL_DELIVERIES,
    BlockScanner,
    CallWalker,
    Scan,
)

CALL_DTYPE = np.dtype(
    [
        ("depth", "<i4"),  #: nesting level; 0 is the shallowest level seen in the trace
        ("function", "<i4"),  #: index into CallHistory.names; -1: no symbol
        ("how", "u1"),  #: kernels.HOW_*: how the segment was entered
        ("address", "<u8"),  #: where it was entered (its first block's start)
        ("first_block", "<i8"),  #: index of its first block in the thread's block sequence
        ("blocks", "<i8"),  #: how many blocks it ran
    ],
    align=True,
)
HOW_NAMES = ("start", "call", "return", "tail call", "unwind", "jump", "resume", "signal")

BREAK_DTYPE = np.dtype(
    [
        ("block", "<i8"),  #: the chain breaks right before this block (index, as CALL_DTYPE's)
        ("lost", "<u8"),  #: records lost there (LOST records); 0 for untraced code
        ("untraced", "u1"),  #: GapReason of the untraced code that ran there; 0 for a loss
        ("times", "<u4"),  #: how many times it ran there (signal handlers); 0 for a loss
    ],
    align=True,
)


def describe_break(row: np.void) -> str:
    """One line for a break of the chain or an untraced handler run (a BREAK_DTYPE row of
    Trace.marks), as the views print it."""
    if int(row["untraced"]) == GapReason.SIGNAL:
        times = int(row["times"])
        return (
            "a signal handler ran here, untraced"
            + (f" ({times:,} times)" if times > 1 else "")
            + ", and the thread went on where it was"
        )
    if int(row["untraced"]) == GapReason.FORK:
        return "fork() ran here, untraced"
    if int(row["untraced"]) == GapReason.LEFT_HANDLER:
        return (
            "a signal handler ran here, untraced, and left elsewhere (siglongjmp, or a pc it moved)"
        )
    if int(row["untraced"]):
        return f"untraced code ran here (gap reason {int(row['untraced'])})"
    lost = int(row["lost"])
    return f"{lost:,} records lost here" if lost else "records lost here"


#: system call numbers that end a thread (THREAD_EXIT's `number`)
_EXIT_CALLS = {60: "exit", 231: "exit_group", 59: "execve", 322: "execveat"}
EXEC_CALLS = ("execve", "execveat")
_ENDS = (RecordType.THREAD_EXIT, RecordType.FAULT)
_END_WORDS = 128  #: the end record, and at most a LOST or GAP record after it
#: words of a thread's end decoded by tail() at least: the whole of most traces
_TAIL_WORDS = 1 << 22
_SI_KERNEL = 0x80  #: si_code of a fault the CPU raised with no address (general protection)


@dataclass(frozen=True)
class ThreadEnd:
    """How a thread's trace ends, when its last record says: it ended itself (THREAD_EXIT)
    or took a fault (FAULT) and ran nothing traced after it."""

    time_ns: int
    #: the system call instruction; for a fault, the instruction that faulted (after
    #: abort(), the one after the system call that raised SIGABRT); 0: not known
    address: int
    status: int | None  #: exit's argument; None for an exec or a fault
    #: "exit" (the thread ends), "exit_group" (the whole process does), "execve" /
    #: "execveat" (the process's program image does), or "fault"
    call: str
    signal: int | None = None  #: a fault's signal
    fault_address: int | None = None  #: the memory a SIGSEGV's or SIGBUS's access tried
    access: FaultAccess = FaultAccess.UNKNOWN

    @property
    def last(self) -> int:
        """The last instruction the thread ran or tried (0: not known)."""
        if self.signal == signal.SIGABRT and self.address:
            return self.address - 2  # the `syscall` that raised it
        return self.address

    def describe(self, where: str = "here") -> str:
        if self.call == "fault":
            return self._describe_fault(where)
        if self.call in EXEC_CALLS:
            return f"the process exec'ed a new program {where}: {self.call}()"
        whom = "the process" if self.call == "exit_group" else "the thread"
        return f"{whom} ended {where}: {self.call}({self.status})"

    def _describe_fault(self, where: str) -> str:
        if self.signal == signal.SIGABRT:
            return f"the program aborted {where}: the system call raised SIGABRT"
        return f"the program crashed {where}: {self.fault_text()}"

    def fault_text(self) -> str:
        """The fault alone: its signal, and the access that faulted when the CPU says."""
        name = signal_name(self.signal or 0)
        if self.fault_address is None:
            return name
        access = {
            FaultAccess.READ: "a read of",
            FaultAccess.WRITE: "a write to",
            FaultAccess.EXECUTE: "a jump to",
        }.get(self.access, "an access to")
        return f"{name}, {access} address {self.fault_address:#x}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def thread_end(words: np.ndarray) -> ThreadEnd | None:
    """The THREAD_EXIT or FAULT record that ends a thread's records, if any.  A thread's
    end is the last thing it writes (then, at most, a LOST or GAP record), and a word with
    bit 63 set is always a record header, so the tail alone is enough.  One followed by
    blocks is not an end (an exec that failed, a fault the program's handler recovered
    from)."""
    tail = np.ascontiguousarray(words[-_END_WORDS:], np.uint64)
    rtype = (tail >> np.uint64(TYPE_SHIFT)) & np.uint64(TYPE_MASK)
    is_header = (tail >> np.uint64(63)).astype(bool)
    headers = np.flatnonzero(is_header & np.isin(rtype, _ENDS))
    if headers.size == 0:
        return None
    i = int(headers[-1])
    n = int((tail[i] >> np.uint64(LEN_SHIFT)) & np.uint64(LEN_MASK))
    after = tail[i + 1 + n :]
    if np.any(~(after >> np.uint64(63)).astype(bool) & (after != 0) & ~_payloads(after)):
        return None
    if int(rtype[i]) == RecordType.FAULT:
        return _fault(tail[i : i + 1 + n])
    payload = [int(w) for w in tail[i + 1 : i + 1 + n]] + [0] * 5
    address = int(unpayload(np.array(payload[1:2], np.uint64))[0])
    call = _EXIT_CALLS.get(payload[3], f"system call {payload[3]}")
    status = int(np.uint32(payload[2] & 0xFFFFFFFF).view(np.int32))  # exit() takes an int
    return ThreadEnd(payload[0], address, None if call in EXEC_CALLS else status, call)


def _fault(record: np.ndarray) -> ThreadEnd:
    """A FAULT record's words (its header, then its payload) as the end they make."""
    payload = [int(w) for w in record[1:]] + [0] * 5
    address, fault_address = (int(a) for a in unpayload(np.array(payload[1:3], np.uint64)))
    signum = int(record[0] & np.uint64(ARG_MASK))
    # si_addr is the memory of a SIGSEGV's or SIGBUS's access: not of one the CPU refused
    # outright (SI_KERNEL: a general protection fault, a non-canonical address)
    code = int(np.uint32(payload[4] & 0xFFFFFFFF).view(np.int32))
    memory = signum in (signal.SIGBUS, signal.SIGSEGV) and code != _SI_KERNEL
    return ThreadEnd(
        payload[0],
        address,
        None,
        "fault",
        signum,
        fault_address if memory else None,
        FaultAccess(payload[3] if payload[3] <= FaultAccess.EXECUTE else 0),
    )


def faults_in(words: np.ndarray) -> list[tuple[int, ThreadEnd]]:
    """Each FAULT record among a thread's (expanded) words, oldest first, with the index
    of the block it was taken in: the one recorded before it.  Only the few record headers
    are looked at, never each word."""
    w = np.asarray(words, np.uint64)
    headers = np.flatnonzero(w >= np.uint64(1 << 63))
    if headers.size == 0:
        return []
    rtype = (w[headers] >> np.uint64(TYPE_SHIFT)) & np.uint64(TYPE_MASK)
    lengths = ((w[headers] >> np.uint64(LEN_SHIFT)) & np.uint64(LEN_MASK)).astype(np.int64)
    is_fault = rtype == RecordType.FAULT
    if not is_fault.any():
        return []
    # the blocks before a header: its words before it, less the headers and their payloads,
    # plus the BLOCK_FAR records (headers that are blocks)
    payload_before = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    far_before = np.concatenate([[0], np.cumsum(rtype == RecordType.BLOCK_FAR)])[:-1]
    blocks_before = headers - np.arange(headers.size) - payload_before + far_before
    found = zip(
        headers[is_fault].tolist(),
        lengths[is_fault].tolist(),
        blocks_before[is_fault].tolist(),
        strict=True,
    )
    return [(before - 1, _fault(w[h : h + 1 + n])) for h, n, before in found]


def _payloads(words: np.ndarray) -> np.ndarray:
    """Which of `words` (whole records) are payload words of the records among them."""
    out = np.zeros(words.size, bool)
    headers = np.flatnonzero((words >> np.uint64(63)).astype(bool))
    for h in headers.tolist():
        n = int((words[h] >> np.uint64(LEN_SHIFT)) & np.uint64(LEN_MASK))
        out[h + 1 : h + 1 + n] = True
    return out


@dataclass
class CallHistory:
    """One thread's function-call history: a segment per stretch of a function between
    calls and returns (GDB's `record function-call-history`), oldest first."""

    tid: int
    segments: np.ndarray  #: CALL_DTYPE
    names: list[str]  #: function names by id
    modules: list[str]  #: module file name by function id
    mid_stack: bool  #: the trace begins inside calls whose entries it does not hold
    #: ModuleMap.symbolize of the thread's process: names code without a symbol
    symbolize: Callable[[np.ndarray], list[str]]

    def function_name(self, fid: int) -> str:
        return self.names[fid] if fid >= 0 else "??"

    def module_name(self, fid: int) -> str:
        return self.modules[fid] if fid >= 0 else "??"

    def call_counts(self) -> dict[str, int]:
        """Calls per function name (tail calls included; PLT stubs are not functions of
        their own: the function behind one counts), most called first.  A function with
        no symbol (a stripped library's own) is named by its entry, `module+0xoff`."""
        seg = self.segments
        counts = _calls_per_function(seg["function"], seg["how"], _stubs(self.names))
        into_unnamed = (seg["how"] == HOW_CALL) & (seg["function"] < 0)
        return _named_counts(
            counts, self.names, self.symbolize, _entered(seg["address"][into_unnamed])
        )


def _stubs(names: list[str]) -> np.ndarray:
    """Which function ids are PLT stubs: no functions of their own (the function behind
    one counts)."""
    return np.array([n.endswith("@plt") or n.startswith(".plt") for n in names], bool)


def _calls_per_function(function: np.ndarray, how: np.ndarray, stubs: np.ndarray) -> np.ndarray:
    """How many of the segments (function and how columns) are calls, per function id
    (as many as `stubs`, which says the ids of PLT stubs: none counted)."""
    fids = function[(how == HOW_CALL) | (how == HOW_TAIL)]
    fids = fids[fids >= 0]
    return np.bincount(fids[~stubs[fids]], minlength=stubs.size)


def _entered(entries: np.ndarray) -> Counter[int]:
    """How many calls entered code at each address."""
    targets, counts = np.unique(entries, return_counts=True)
    return Counter(dict(zip(targets.tolist(), counts.tolist(), strict=True)))


def _named_counts(
    counts: np.ndarray,
    names: list[str],
    symbolize: Callable[[np.ndarray], list[str]],
    unnamed: Counter[int],
) -> dict[str, int]:
    """Calls per function name (aliases' counts merged) from the calls per function id
    and those of code without a symbol by entry (named `module+0xoff`), most called
    first."""
    merged: dict[str, int] = {}
    for fid in np.flatnonzero(counts).tolist():
        name = names[fid]
        merged[name] = merged.get(name, 0) + int(counts[fid])
    entries = np.array(sorted(unnamed), np.uint64)
    for name, entry in zip(symbolize(entries), entries.tolist(), strict=True):
        merged[name] = merged.get(name, 0) + unnamed[entry]
    return dict(sorted(merged.items(), key=lambda kv: (-kv[1], kv[0])))


def _enter_blockless(seg: np.ndarray, break_at: np.ndarray, break_detail: np.ndarray) -> None:
    """Where the segments of no block of their own were entered: a handler another
    signal interrupted at its first instruction, entered where that signal came, the
    detail of the next of the deliveries chained before the block (kernels.Scan).  `seg`
    must hold every segment that begins at such a block."""
    first = seg["first_block"]
    for z in np.flatnonzero(seg["blocks"] == 0).tolist():
        at = int(first[z])
        nth = z - int(np.searchsorted(first, at))
        seg["address"][z] = break_detail[np.searchsorted(break_at, at) + 1 + nth]


class Trace:
    """A recording directory, decoded on demand (per thread, cached)."""

    def __init__(self, path: str | os.PathLike[str], piece_words: int | None = None) -> None:
        self.dir = TraceDir.open(path)
        #: words decoded at a time, at most (None: a piece of the stream file at a time)
        self.piece_words = piece_words
        self.path = Path(path)
        self._modules: dict[int, ModuleMap] = {}
        self._blocks: dict[int, Blocks] = {}
        self._ends: dict[int, ThreadEnd | None] = {}
        self._faults: dict[int, list[tuple[int, ThreadEnd]]] = {}
        self._calls: dict[int, CallHistory] = {}
        #: breaks and handler runs of threads _walk() read, whose blocks are not kept
        self._scanned: dict[int, Scan] = {}
        self._block_counts: dict[int, int] = {}  #: blocks of the threads _walk() read
        self._tails: dict[int, int] = {}  #: threads decoded only at their end: blocks wanted
        self._partial: set[int] = set()  #: threads whose decoded blocks are not all theirs

    @cached_property
    def meta(self) -> dict[str, Any]:
        return self.dir.meta()

    @cached_property
    def threads(self) -> list[int]:
        return self.dir.threads()

    def pid_of(self, tid: int) -> int:
        return self.dir.thread_pid(tid, self.meta)

    def modules(self, tid: int) -> ModuleMap:
        """The modules of the thread's process, from the recording's module records."""
        pid = self.pid_of(tid)
        if pid not in self._modules:
            loads = [(m.base, m.size, m.path) for m in self.dir.modules(pid) if m.event == "load"]
            self._modules[pid] = ModuleMap(loads)
        return self._modules[pid]

    def words(self, tid: int) -> np.ndarray:
        return self.dir.words(tid)[0]

    def blocks(self, tid: int) -> Blocks:
        """The thread's blocks, decoded a piece of its words at a time: 4 bytes a block
        kept (twice that while the pieces' ids are joined), where the words of a stream
        take 8 expanded, and each piece's only while it is decoded.  After tail(tid, n):
        only its newest blocks, at least n of them."""
        if tid not in self._blocks:
            self._check_tid(tid)
            if tid in self._tails:
                self._decode_tail(tid, self._tails[tid])
                return self._blocks[tid]
            scanner = BlockScanner()
            parts: list[np.ndarray] = []
            faults: list[tuple[int, ThreadEnd]] = []
            for piece in self.dir.word_pieces(tid, self.piece_words):
                base = scanner.block_count
                parts.append(scanner.feed(piece))
                faults += [(base + block, fault) for block, fault in faults_in(piece)]
            ids = parts[0] if len(parts) == 1 else np.concatenate([np.zeros(0, np.int32), *parts])
            self._blocks[tid] = blocks_of(scanner.finish(ids), self.modules(tid))
            self._faults[tid] = faults
        return self._blocks[tid]

    def tail(self, tid: int, blocks: int) -> None:
        """Decode from now on only the end of the thread's trace that holds its newest
        `blocks` blocks (or all of it, when that is little more): what `show` and `insns`
        print, read without the rest of a stream of billions of blocks.  Block indices
        (`branches`' block, `marks`, `faults`) then count from the first block decoded;
        `partial(tid)` says whether that is the thread's first."""
        self._tails[tid] = max(blocks, 0)
        for cache in (self._blocks, self._faults, self._calls, self._scanned):
            cache.pop(tid, None)
        self._partial.discard(tid)

    def partial(self, tid: int) -> bool:
        """Whether the decoded blocks of the thread are only the newest of its trace."""
        self.blocks(tid)
        return tid in self._partial

    def _decode_tail(self, tid: int, wanted: int) -> None:
        words = max(4 * wanted, _TAIL_WORDS)
        while True:
            tail = self.dir.tail_words(tid, words)
            found = BlockScanner()
            ids = found.feed(tail)
            if ids.size >= wanted or tail.size < words:
                break
            words *= 4
        self._blocks[tid] = blocks_of(found.finish(ids), self.modules(tid))
        self._faults[tid] = faults_in(tail)
        if tail.size >= words:  # perhaps all of it: said so only when known
            self._partial.add(tid)

    def end(self, tid: int) -> ThreadEnd | None:
        """Where the thread ended itself (exit, exit_group, or an exec that replaced its
        program), if its trace says so; None for a thread that was killed, crashed with the
        process, or was still running when the recording stopped."""
        if tid not in self._ends:
            self._check_tid(tid)
            self._ends[tid] = thread_end(self.dir.tail_words(tid, _END_WORDS))
        return self._ends[tid]

    def faults(self, tid: int) -> list[tuple[int, ThreadEnd]]:
        """The faults the thread took, oldest first, each with the index of the block it
        was in: those a handler of the program recovered from, and the one that ended it
        (also `end(tid)`)."""
        self.blocks(tid)
        return self._faults[tid]

    def _chain(self, tid: int) -> Blocks | Scan:
        """The thread's breaks and handler runs: of its blocks, or of the pass of
        the call-history walk (_walk) that read them all when its blocks were not kept."""
        if tid in self._scanned and tid not in self._blocks and tid not in self._tails:
            return self._scanned[tid]
        return self.blocks(tid)

    def breaks(self, tid: int) -> np.ndarray:
        """Where the thread's chain of blocks breaks, oldest first (BREAK_DTYPE): records
        were lost there, or code ran untraced (fork()).  No branch is inferred across a
        break.  A signal delivered to a traced handler is a branch (INTERRUPT), and so is
        the handler's way back (rt_sigreturn, SYSCALL): not breaks."""
        blocks = self._chain(tid)
        keep = ~np.isin(blocks.break_kind, (*SIGNAL_DELIVERIES, BREAK_SIGRETURN))
        out = np.zeros(int(keep.sum()), BREAK_DTYPE)
        out["block"] = blocks.break_at[keep]
        kind, detail = blocks.break_kind[keep], blocks.break_detail[keep]
        out["lost"] = np.where(kind == BREAK_LOST, detail, 0)
        out["untraced"] = np.where(kind == BREAK_GAP, detail, 0)
        out["times"] = kind == BREAK_GAP
        return out

    def marks(self, tid: int) -> np.ndarray:
        """What the views mark between branches, oldest first (BREAK_DTYPE): the breaks,
        and the signal handlers that ran untraced (GAP records of reason signal; untraced
        GapReason.SIGNAL, `block` the block after the one they ran in), which break
        nothing.  A handler that left elsewhere is said by its break (LEFT_HANDLER) only."""
        blocks = self._chain(tid)
        breaks = self.breaks(tid)
        handlers = np.zeros(blocks.handler_at.size, BREAK_DTYPE)
        handlers["block"] = blocks.handler_at
        handlers["untraced"] = GapReason.SIGNAL
        handlers["times"] = blocks.handler_times
        left = breaks["block"][breaks["untraced"] == GapReason.LEFT_HANDLER]
        handlers["times"] -= np.isin(handlers["block"], left)
        handlers = handlers[handlers["times"] > 0]
        both = np.concatenate([handlers, breaks])
        # a handler ran inside the block before its place, so before a break there
        return both[np.argsort(both["block"], kind="stable")]

    def _check_tid(self, tid: int) -> None:
        if tid not in self.threads:
            known = ", ".join(map(thread_label, self.threads)) or "none"
            raise InvalidArgumentError(
                f"thread {thread_label(tid)} is not in {self.path}",
                hint=f"threads recorded: {known}",
            )

    def branches(self, tid: int, last: int | None = None) -> np.ndarray:
        """Taken branches, oldest first: structured array (from, to, kind, block).
        `last`: only the newest `last` (decoding just the end of the trace)."""
        blocks = self.blocks(tid)
        if last is None:
            return branches_of(blocks)
        window = 4 * last + 16
        while True:
            found = branches_of(blocks, max(blocks.ids.size - window, 0))
            if found.size >= last:
                return found[found.size - last :]
            if window < blocks.ids.size:
                window *= 4
            elif tid in self._partial:  # too few branches among the blocks decoded
                self.tail(tid, 4 * blocks.ids.size)
                blocks = self.blocks(tid)
            else:
                return found

    def calls(self, tid: int) -> CallHistory:
        """The function-call history of thread `tid`."""
        if tid not in self._calls:
            self._calls[tid] = self._call_history(tid)
        return self._calls[tid]

    def call_pieces(self, tid: int) -> Iterator[np.ndarray]:
        """Thread `tid`'s function-call history (CALL_DTYPE rows) a piece of its words at
        a time, oldest first, with depths counted from the first block's (not rebased to
        the shallowest: that is known at the end; `calls` rebases them): the memory of a
        piece, however long the trace.  Once all are read, marks() and breaks() need no
        other pass."""
        held = np.zeros(0, CALL_DTYPE)  # the last segment: its length is not known yet
        walk = None
        for walk in self._walk(tid):
            seg = np.zeros(held.size + walk.first.size, CALL_DTYPE)
            seg[: held.size] = held
            new = seg[held.size :]
            new["depth"], new["function"], new["how"] = walk.depth, walk.fid, walk.how
            new["first_block"], new["address"] = walk.first, walk.entries()
            seg["blocks"][:-1] = np.diff(seg["first_block"])
            _enter_blockless(seg[:-1], *walk.scanner.breaks_before(walk.scanner.block_count)[::2])
            held = seg[-1:].copy()
            if seg.size > 1:
                yield seg[:-1]
        if held.size and walk is not None:
            held["blocks"] = walk.scanner.block_count - held["first_block"]
            yield held

    def _walk(self, tid: int) -> Iterator[_Walked]:
        """The call-history kernel's walk of the thread's blocks, a piece of its words at
        a time (the pieces that begin a segment); at the end, its breaks and handler runs
        are kept for marks()."""
        self._check_tid(tid)
        modules = self.modules(tid)
        scanner, distinct, walker = BlockScanner(), DistinctBlocks(modules), CallWalker()
        for piece in self.dir.word_pieces(tid, self.piece_words):
            base = scanner.block_count
            ids = scanner.feed(piece)
            distinct.update(scanner.distinct)
            tables = (*distinct.tables(), modules.function_starts)
            first, depth, fid, how = walker.walk_piece(scanner, ids, tables)
            if first.size:
                yield _Walked(first, depth, fid, how, ids, base, distinct.start, scanner)
        self._scanned[tid] = scanner.finish(np.zeros(0, np.int32))
        self._block_counts[tid] = scanner.block_count

    def _call_history(self, tid: int) -> CallHistory:
        modules = self.modules(tid)
        # one array of rows, written piece after piece and grown by doubling: fresh pages
        # cost a fault each on a VM, and joining the pieces' columns at the end wrote all
        # the rows twice more (66.7M segments: 12.5-15.8 s so, 10.0-12.8 s now, 9.9-10.6 s
        # at f52c86d, which kept every block)
        seg = np.empty(1 << 16, CALL_DTYPE)
        n = 0
        for walk in self._walk(tid):
            end = n + walk.first.size
            if end > seg.size:
                grown = np.empty(max(2 * seg.size, end), CALL_DTYPE)
                grown[:n] = seg[:n]
                seg = grown
            rows = seg[n:end]
            rows["depth"], rows["function"], rows["how"] = walk.depth, walk.fid, walk.how
            rows["first_block"], rows["address"] = walk.first, walk.entries()
            n = end
        seg = seg[:n]
        lowest = int(seg["depth"].min()) if n else 0
        seg["depth"] -= lowest
        first = seg["first_block"]
        chain = self._scanned[tid]
        seg["blocks"] = np.diff(first, append=self._block_counts[tid])
        _enter_blockless(seg, chain.break_at, chain.break_detail)
        return CallHistory(
            tid,
            seg,
            modules.function_names,
            modules.function_modules,
            lowest < 0,
            modules.symbolize,
        )

    def stats(self, tids: list[int] | None = None) -> dict[str, Any]:
        """Calls per function: overall, and per thread (of `tids`, default all; by
        thread_label: "id#2" for the second thread with an id)."""
        overall: dict[str, int] = {}
        threads: dict[str, dict[str, int]] = {}
        for tid in self.threads if tids is None else tids:
            counts = self._thread_call_counts(tid)
            threads[thread_label(tid)] = counts
            for name, n in counts.items():
                overall[name] = overall.get(name, 0) + n
        functions = dict(sorted(overall.items(), key=lambda kv: (-kv[1], kv[0])))
        return {"functions": functions, "threads": threads}

    def _thread_call_counts(self, tid: int) -> dict[str, int]:
        """call_counts of one thread, decoded a piece of its words at a time and keeping
        nothing of it: `stats` over a thread of 3.8 billion blocks (15 GB of ids alone)
        needs the memory of a piece."""
        if tid in self._calls:
            return self._calls[tid].call_counts()
        self._check_tid(tid)
        modules = self.modules(tid)
        names = modules.function_names
        counts = np.zeros(len(names), np.int64)
        unnamed: Counter[int] = Counter()
        stubs = _stubs(names)
        for walk in self._walk(tid):
            counts += _calls_per_function(walk.fid, walk.how, stubs)
            into_unnamed = (walk.how == HOW_CALL) & (walk.fid < 0)
            unnamed.update(_entered(walk.entries(into_unnamed)))
        return _named_counts(counts, names, modules.symbolize, unnamed)


class _Walked(NamedTuple):
    """The segments the call-history walk began in a piece of a thread's words."""

    first: np.ndarray  #: their first blocks (counted from the thread's first)
    depth: np.ndarray  #: not rebased: from 0 at the thread's first block
    fid: np.ndarray
    how: np.ndarray
    ids: np.ndarray  #: the piece's blocks ...
    base: int  #: ... from this one of the thread's on
    start: np.ndarray  #: each distinct block's start
    scanner: BlockScanner  #: what scanned the words, up to this piece

    def entries(self, which: np.ndarray | None = None) -> np.ndarray:
        """The address each segment (of `which`) was entered at: its first block's start
        (a segment begins at a block of this piece, after the previous piece's last)."""
        first = self.first if which is None else self.first[which]
        return self.start[self.ids[first - self.base]]


def open(path: str | os.PathLike[str] = "branchtrace.data") -> Trace:
    """Open a recording directory."""
    return Trace(path)
