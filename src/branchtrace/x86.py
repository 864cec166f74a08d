"""x86-64 instruction classes, for every layer that needs to know a branch when it sees
one (the step engine while stepping, the decoder afterwards): one definition."""

from __future__ import annotations

from capstone import (
    CS_AC_WRITE,
    CS_ARCH_X86,
    CS_GRP_CALL,
    CS_GRP_INT,
    CS_GRP_JUMP,
    CS_GRP_RET,
    CS_MODE_64,
    Cs,
)
from capstone import x86 as cx86

from .store.format import BranchKind, FaultAccess

#: the last instruction is not a branch (a block split); UNKNOWN: its code was not readable
NOT_A_BRANCH = 0
UNKNOWN = 255

_cs = Cs(CS_ARCH_X86, CS_MODE_64)
_cs.detail = True


def classify(code: bytes, address: int) -> tuple[int, int]:
    """(kind, length) of the instruction at `address`; kind NOT_A_BRANCH if not a branch,
    UNKNOWN (length 0) if `code` does not start with a valid instruction."""
    kind, size, _ = direct_jump(code, address)
    return kind, size


def direct_jump(code: bytes, address: int) -> tuple[int, int, int]:
    """classify's (kind, length), and the target of a jump or call whose target is in the
    instruction (0 for any other)."""
    insn = next(_cs.disasm(code, address, 1), None)
    if insn is None:
        return UNKNOWN, 0, 0
    direct = bool(insn.operands) and insn.operands[0].type == cx86.X86_OP_IMM
    target = int(insn.operands[0].imm) if direct else 0
    if insn.group(CS_GRP_CALL):
        return (
            (BranchKind.CALL, insn.size, target)
            if direct
            else (BranchKind.INDIRECT_CALL, insn.size, 0)
        )
    if insn.group(CS_GRP_RET):
        return BranchKind.RETURN, insn.size, 0
    if insn.group(CS_GRP_JUMP):
        if insn.id == cx86.X86_INS_JMP:
            return (
                (BranchKind.JUMP, insn.size, target)
                if direct
                else (BranchKind.INDIRECT_JUMP, insn.size, 0)
            )
        return BranchKind.CONDITIONAL, insn.size, target
    if insn.id in (cx86.X86_INS_SYSCALL, cx86.X86_INS_SYSENTER) or insn.group(CS_GRP_INT):
        return BranchKind.SYSCALL, insn.size, 0
    return NOT_A_BRANCH, insn.size, 0


#: instructions that write or read the stack with no operand that says so
_STACK_WRITES = {cx86.X86_INS_PUSH, cx86.X86_INS_PUSHFQ, cx86.X86_INS_CALL, cx86.X86_INS_ENTER}
_STACK_READS = {cx86.X86_INS_POP, cx86.X86_INS_POPFQ, cx86.X86_INS_RET, cx86.X86_INS_LEAVE}


def memory_access(code: bytes, address: int) -> FaultAccess:
    """What the instruction at `address` does to memory, through its operands or the stack
    (a push, a call: a stack overflow's fault): WRITE if it writes, READ if it only reads;
    UNKNOWN without memory, or when it reads one place and writes another (a push of a
    memory operand), which a fault's address alone cannot tell apart."""
    insn = next(_cs.disasm(code, address, 1), None)
    if insn is None:
        return FaultAccess.UNKNOWN
    memory = [op for op in insn.operands if op.type == cx86.X86_OP_MEM]
    accesses = set()
    if memory:
        writes = any(op.access & CS_AC_WRITE for op in memory)
        accesses.add(FaultAccess.WRITE if writes else FaultAccess.READ)
    if insn.id in _STACK_WRITES:
        accesses.add(FaultAccess.WRITE)
    elif insn.id in _STACK_READS:
        accesses.add(FaultAccess.READ)
    return accesses.pop() if len(accesses) == 1 else FaultAccess.UNKNOWN
