"""From BLOCK records to branches {from, to, kind}.

Each BLOCK record names an executed block by its start and its last instruction.  Between
two consecutive blocks A and B the transfer is A.last -> B.start, unless B starts right
after A.last (a conditional jump not taken, a system call, or a block split without a
branch).  The kind
comes from decoding A's last instruction, once per distinct block (capstone): a program
runs millions of blocks but has only thousands of distinct ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..store import BranchKind
from ..symbols import ModuleMap
from ..x86 import NOT_A_BRANCH, UNKNOWN, classify, direct_jump
from .kernels import (
    SIGNAL_DELIVERIES,
    BlockScanner,
    Scan,
    block_bounds,
    branch_part,
)

#: aligned (32 bytes a branch): filling 100M packed 25-byte records costs three times more
BRANCH_DTYPE = np.dtype(
    [("from", "<u8"), ("to", "<u8"), ("kind", "u1"), ("block", "<i8")], align=True
)

# An Interceptor hook (Frida's on exit/fork/..., ours on main) overwrites a function's first
# instructions with a jump to Frida's code, which runs them relocated and jumps back a few
# bytes on: the file shows no branch, the next block starts a little later.  Those
# instructions did run: a fall-through, not an interrupt.
_HOOK_REACH = np.uint64(32)  #: bytes an x86-64 Interceptor hook relocates, at most


def hook_heads(
    kinds: np.ndarray, last: np.ndarray, sizes: np.ndarray, modules: ModuleMap
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each distinct block whose last instruction is no branch, the first jump in the
    file within a hook's reach after it, when its target is in the instruction: (address,
    target, kind), kind 0 where there is none.  A block that a hook's jump ended is
    followed by the hooked function's head, run relocated by Frida, which records nothing:
    a jump taken there shows only as the next block starting at its target (a signal
    handler that begins `cmp edi, 10; je`)."""
    at = np.zeros(kinds.size, np.uint64)
    to = np.zeros(kinds.size, np.uint64)
    kind = np.zeros(kinds.size, np.uint8)
    for j in np.flatnonzero(kinds == NOT_A_BRANCH).tolist():
        address = int(last[j]) + int(sizes[j])
        m = int(modules.index(np.array([address], np.uint64))[0])
        image = modules.image(m) if m >= 0 else None
        if image is None:
            continue
        end = address + int(_HOOK_REACH)
        code = image.read(modules.file_address(m, address), int(_HOOK_REACH) + 16)
        pc = address
        while pc < end and pc - address < len(code):
            k, size, target = direct_jump(code[pc - address :], pc)
            if k == UNKNOWN:
                break
            if k != NOT_A_BRANCH:
                if k in (BranchKind.JUMP, BranchKind.CONDITIONAL) and target:
                    at[j], to[j], kind[j] = pc, target, k
                break
            pc += size
    return at, to, kind


def classify_addresses(addresses: np.ndarray, modules: ModuleMap) -> tuple[np.ndarray, np.ndarray]:
    """Kind and length of the instruction at each (distinct) address."""
    kinds = np.full(addresses.size, UNKNOWN, dtype=np.uint8)
    sizes = np.zeros(addresses.size, dtype=np.uint64)
    mod = modules.index(addresses)
    for j, (addr, m) in enumerate(zip(addresses.tolist(), mod.tolist(), strict=True)):
        if m < 0:
            continue
        image = modules.image(m)
        if image is None:
            continue
        code = image.read(modules.file_address(m, addr), 16)
        if code:
            kinds[j], sizes[j] = classify(code, addr)
    return kinds, sizes


@dataclass
class Blocks:
    """A thread's executed blocks: a sequence of ids into per-distinct-block tables."""

    ids: np.ndarray  #: int32, oldest first
    break_at: np.ndarray  #: int64: the chain breaks right before these blocks ...
    break_kind: np.ndarray  #: uint8 kernels.BREAK_*: ... for these reasons ...
    break_detail: np.ndarray  #: uint64: ... with these details (kernels.scan_blocks)
    start: np.ndarray  #: uint64 per distinct block
    last: np.ndarray  #: uint64 per distinct block: address of its last instruction
    kind: np.ndarray  #: uint8 per distinct block: BranchKind of its last instruction, or 0
    size: np.ndarray  #: uint64 per distinct block: length of its last instruction
    #: int64: signal handlers ran untraced inside the block before these ...
    handler_at: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: uint32: ... this many times (kernels.Scan)
    handler_times: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    #: uint64, uint64, uint8 per distinct block (empty: none known): the jump in the
    #: relocated head of a hooked function after it (hook_heads)
    head_at: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    head_to: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    head_kind: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))

    @classmethod
    def of_scan(
        cls, found: Scan, start: np.ndarray, last: np.ndarray, kind: np.ndarray, size: np.ndarray
    ) -> Blocks:
        """The blocks scan_blocks found, with each distinct block's bounds (block_bounds)
        and the kind and length of its last instruction."""
        return cls(
            found.ids,
            found.break_at,
            found.break_kind,
            found.break_detail,
            start,
            last,
            kind,
            size,
            found.handler_at,
            found.handler_times,
        )

    def kernel_args(
        self,
    ) -> tuple[
        np.ndarray,
        np.ndarray,
        np.ndarray,
        np.ndarray,
        np.ndarray,
        np.ndarray,
        np.ndarray,
        np.ndarray,
    ]:
        """The arrays the numba kernels take, in their order."""
        return (
            self.ids,
            self.break_at,
            self.break_kind,
            self.break_detail,
            self.start,
            self.last,
            self.kind,
            self.size,
        )


class DistinctBlocks:
    """Per distinct block a BlockScanner found: start, last instruction's address, kind
    and length, and the id of the function it starts in; grown as the scanner finds more,
    each block decoded once (in arrays of doubling capacity: a JIT's code adds blocks
    piece after piece)."""

    def __init__(self, modules: ModuleMap) -> None:
        self.modules = modules
        self.count = 0
        self._columns: dict[str, np.ndarray] = {
            "start": np.zeros(16, np.uint64),
            "last": np.zeros(16, np.uint64),
            "kind": np.zeros(16, np.uint8),
            "size": np.zeros(16, np.uint64),
            "func": np.zeros(16, np.int64),
        }

    @property
    def start(self) -> np.ndarray:
        return self._columns["start"][: self.count]

    def tables(self) -> tuple[np.ndarray, ...]:
        """(start, last, kind, size, func), as CallWalker takes them."""
        return tuple(c[: self.count] for c in self._columns.values())

    def update(self, unique: np.ndarray) -> None:
        """Take in the blocks of `unique` (the scanner's, by id) not yet known."""
        new = unique[self.count :]
        if new.size == 0:
            return
        start, last = block_bounds(new)
        kind, size = classify_addresses(last, self.modules)
        func, _ = self.modules.function_ids(start)
        found = {"start": start, "last": last, "kind": kind, "size": size, "func": func}
        end = self.count + new.size
        for name, column in list(self._columns.items()):
            if end > column.size:
                grown = np.zeros(max(2 * column.size, end), column.dtype)
                grown[: self.count] = column[: self.count]
                self._columns[name] = column = grown
            column[self.count : end] = found[name]
        self.count = end


def blocks_of(found: Scan, modules: ModuleMap) -> Blocks:
    """The Blocks of a scan, each distinct block decoded."""
    start, last = block_bounds(found.unique)
    kind, size = classify_addresses(last, modules)
    blocks = Blocks.of_scan(found, start, last, kind, size)
    blocks.head_at, blocks.head_to, blocks.head_kind = hook_heads(kind, last, size, modules)
    return blocks


def scan(words: np.ndarray, modules: ModuleMap) -> Blocks:
    scanner = BlockScanner()
    return blocks_of(scanner.finish(scanner.feed(words)), modules)


_CHUNK = 1 << 23  #: blocks decoded at a time, to bound the temporaries


def branches_of(blocks: Blocks, first: int = 0) -> np.ndarray:
    """Taken transfers between consecutive blocks from block `first` on, oldest first
    (BRANCH_DTYPE); `block` is the index of the block the branch goes to.  Nothing is
    inferred across a LOST or GAP record; a signal delivery is an INTERRUPT branch, and
    the stalker engine's way back from a handler it traced (rt_sigreturn) a SYSCALL one."""
    first = max(first, 0)
    n = blocks.ids.size - 1 - first
    if n <= 0:
        return np.zeros(0, BRANCH_DTYPE)
    # a signal that came right after a block's own branch adds that branch
    interrupts = int(np.isin(blocks.break_kind, SIGNAL_DELIVERIES).sum())
    out = np.empty(n + interrupts, BRANCH_DTYPE)
    chunk = min(n, _CHUNK) + interrupts  # column buffers reused chunk after chunk
    src, dst = np.empty(chunk, np.uint64), np.empty(chunk, np.uint64)
    kind, block = np.empty(chunk, np.uint8), np.empty(chunk, np.int64)
    total = 0
    heads = (blocks.head_at, blocks.head_to, blocks.head_kind)
    if blocks.head_kind.size != blocks.start.size:
        heads = (
            np.zeros_like(blocks.start),
            np.zeros_like(blocks.start),
            np.zeros_like(blocks.kind),
        )
    for lo in range(first, blocks.ids.size - 1, chunk - interrupts):
        hi = min(lo + chunk - interrupts, blocks.ids.size - 1)
        found = branch_part(  # type: ignore[call-arg]
            lo, hi, _HOOK_REACH, *blocks.kernel_args(), *heads, src, dst, kind, block
        )
        part = out[total : total + found]
        part["from"], part["to"] = src[:found], dst[:found]
        part["kind"], part["block"] = kind[:found], block[:found]
        total += found
    return out[:total]
