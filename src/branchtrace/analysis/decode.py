"""From BLOCK records to branches {from, to, kind}.

Each BLOCK record names an executed block by its start and its last instruction.  Between
two consecutive blocks A and B the transfer is A.last -> B.start, unless B starts right
after A.last (a conditional jump not taken, or a block split without a branch).  The kind
comes from decoding A's last instruction, once per distinct block (capstone).
"""

from __future__ import annotations

import numpy as np
from capstone import CS_ARCH_X86, CS_GRP_CALL, CS_GRP_INT, CS_GRP_JUMP, CS_GRP_RET, CS_MODE_64, Cs
from capstone import x86 as cx86

from ..store import BranchKind, RecordType, parse_words
from ..store.tracedir import TraceDir
from ..symbols import ModuleMap

BRANCH_DTYPE = np.dtype([("from", "<u8"), ("to", "<u8"), ("kind", "u1")])
#: the last instruction is not a branch (a block split); UNKNOWN: its code was not readable
NOT_A_BRANCH = 0
UNKNOWN = 255

_cs = Cs(CS_ARCH_X86, CS_MODE_64)
_cs.detail = True


def classify(code: bytes, address: int) -> tuple[int, int]:
    """(kind, length) of the instruction at `address`; kind NOT_A_BRANCH if not a branch."""
    insn = next(_cs.disasm(code, address, 1), None)
    if insn is None:
        return UNKNOWN, 0
    direct = bool(insn.operands) and insn.operands[0].type == cx86.X86_OP_IMM
    if insn.group(CS_GRP_CALL):
        return (BranchKind.CALL if direct else BranchKind.INDIRECT_CALL), insn.size
    if insn.group(CS_GRP_RET):
        return BranchKind.RETURN, insn.size
    if insn.group(CS_GRP_JUMP):
        if insn.id == cx86.X86_INS_JMP:
            return (BranchKind.JUMP if direct else BranchKind.INDIRECT_JUMP), insn.size
        return BranchKind.CONDITIONAL, insn.size
    if insn.id in (cx86.X86_INS_SYSCALL, cx86.X86_INS_SYSENTER) or insn.group(CS_GRP_INT):
        return BranchKind.SYSCALL, insn.size
    return NOT_A_BRANCH, insn.size


def classify_addresses(addresses: np.ndarray, modules: ModuleMap) -> tuple[np.ndarray, np.ndarray]:
    """Kind and length of the instruction at each address (one decode per distinct one)."""
    uniq, inverse = np.unique(addresses, return_inverse=True)
    kinds = np.full(uniq.size, UNKNOWN, dtype=np.uint8)
    sizes = np.zeros(uniq.size, dtype=np.uint64)
    mod = modules.index(uniq)
    for j, (addr, m) in enumerate(zip(uniq.tolist(), mod.tolist(), strict=True)):
        if m < 0:
            continue
        image = modules.image(m)
        if image is None:
            continue
        code = image.read(modules.file_address(m, addr), 16)
        if code:
            kinds[j], sizes[j] = classify(code, addr)
    return kinds[inverse], sizes[inverse]


def decode_blocks(starts: np.ndarray, lasts: np.ndarray, modules: ModuleMap) -> np.ndarray:
    """Taken transfers between consecutive blocks, oldest first (BRANCH_DTYPE)."""
    if starts.size < 2:
        return np.zeros(0, BRANCH_DTYPE)
    kinds, sizes = classify_addresses(lasts[:-1], modules)
    src, dst = lasts[:-1], starts[1:]
    falls_through = dst == src + sizes
    kind = kinds.copy()
    kind[(kinds == NOT_A_BRANCH) & ~falls_through] = BranchKind.INTERRUPT
    taken = ~falls_through | ~np.isin(kinds, (NOT_A_BRANCH, BranchKind.CONDITIONAL))
    taken &= kind != NOT_A_BRANCH
    out = np.zeros(int(taken.sum()), BRANCH_DTYPE)
    out["from"], out["to"], out["kind"] = src[taken], dst[taken], kind[taken]
    return out


def thread_branches(trace: TraceDir, tid: int) -> np.ndarray:
    """All taken branches of one thread of a recording.  LOST and GAP records break the
    chain: no branch is invented across them."""
    words, pos = trace.words(tid)
    recs = parse_words(words, pos)
    loads = trace.modules(trace.thread_pid(tid))
    modules = ModuleMap([(m.base, m.size, m.path) for m in loads if m.event == "load"])
    blocks = recs["type"] == RecordType.BLOCK
    breaks = (recs["type"] == RecordType.LOST) | (recs["type"] == RecordType.GAP)
    segment = np.cumsum(breaks)[blocks]
    starts, lasts = recs["a"][blocks], recs["b"][blocks]
    parts = []
    for s in np.unique(segment):
        sel = segment == s
        parts.append(decode_blocks(starts[sel], lasts[sel], modules))
    return np.concatenate(parts) if parts else np.zeros(0, BRANCH_DTYPE)
