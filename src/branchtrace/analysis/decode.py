"""From BLOCK records to branches {from, to, kind}.

Each BLOCK record names an executed block by its start and its last instruction.  Between
two consecutive blocks A and B the transfer is A.last -> B.start, unless B starts right
after A.last (a conditional jump not taken, or a block split without a branch).  The kind
comes from decoding A's last instruction, once per distinct block (capstone): a program
runs millions of blocks but has only thousands of distinct ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..store import BranchKind
from ..symbols import ModuleMap
from ..x86 import NOT_A_BRANCH, UNKNOWN, classify
from .kernels import BREAK_INTERRUPT, BREAK_NONE, block_bounds, scan_blocks

BRANCH_DTYPE = np.dtype([("from", "<u8"), ("to", "<u8"), ("kind", "u1"), ("block", "<i8")])

_HOOK_REACH = np.uint64(32)  #: bytes an x86-64 Interceptor hook relocates, at most


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
    word_index: np.ndarray  #: int64: where each block's record sits in the thread's words
    breaks: np.ndarray  #: uint8 kernels.BREAK_*: why the chain breaks before each block
    resume: np.ndarray  #: uint64: for BREAK_INTERRUPT, where the interrupted code resumes
    start: np.ndarray  #: uint64 per distinct block
    last: np.ndarray  #: uint64 per distinct block: address of its last instruction
    kind: np.ndarray  #: uint8 per distinct block: BranchKind of its last instruction, or 0
    size: np.ndarray  #: uint64 per distinct block: length of its last instruction


def scan(words: np.ndarray, modules: ModuleMap) -> Blocks:
    ids, widx, breaks, resume, unique = scan_blocks(np.ascontiguousarray(words, np.uint64))
    start, last = block_bounds(unique)
    kind, size = classify_addresses(last, modules)
    return Blocks(ids, widx, breaks, resume, start, last, kind, size)


def branches_of(blocks: Blocks) -> np.ndarray:
    """Taken transfers between consecutive blocks, oldest first (BRANCH_DTYPE); `block` is
    the index of the block the branch goes to.  Nothing is inferred across a LOST or GAP
    record; a signal delivery recorded by the step engine is an INTERRUPT branch."""
    ids = blocks.ids
    if ids.size < 2:
        return np.zeros(0, BRANCH_DTYPE)
    a, b = ids[:-1], ids[1:]
    src, dst = blocks.last[a], blocks.start[b]
    kinds = blocks.kind[a]
    falls_through = dst == src + blocks.size[a]
    # An Interceptor hook (Frida's on exit/fork/..., ours on main) overwrites a function's
    # first instructions with a jump to Frida's code, which runs them relocated and jumps
    # back a few bytes on: the file shows no branch, the next block starts a little later.
    # Those instructions did run; it is a fall-through, not an interrupt.
    falls_through |= (kinds == NOT_A_BRANCH) & (dst > src) & (dst - src <= _HOOK_REACH)
    kind = kinds.copy()
    kind[(kinds == NOT_A_BRANCH) & ~falls_through] = BranchKind.INTERRUPT
    taken = ~falls_through | ~np.isin(kinds, (NOT_A_BRANCH, BranchKind.CONDITIONAL))
    taken &= kind != NOT_A_BRANCH
    brk = blocks.breaks[1:]
    taken &= brk == BREAK_NONE
    interrupt = brk == BREAK_INTERRUPT
    keep = taken | interrupt
    out = np.zeros(int(keep.sum()), BRANCH_DTYPE)
    src = np.where(interrupt, blocks.resume[1:], src)
    kind = np.where(interrupt, BranchKind.INTERRUPT, kind)
    out["from"], out["to"], out["kind"] = src[keep], dst[keep], kind[keep]
    out["block"] = np.flatnonzero(keep) + 1
    return out
