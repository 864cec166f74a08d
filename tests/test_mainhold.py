"""The stub the main thread waits in while Frida attaches (engines/mainhold.py), read back
with capstone: what it touches must be what the recorder writes, and nothing else."""

from __future__ import annotations

import capstone
from capstone import x86

from branchtrace.engines import mainhold


def stub_instructions() -> list[capstone.CsInsn]:
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    insns = list(md.disasm(mainhold.STUB, 0))
    assert sum(i.size for i in insns) == len(mainhold.STUB)  # every byte decodes
    return insns


def rip_relative(insn: capstone.CsInsn) -> int | None:
    for op in insn.operands:
        if op.type == x86.X86_OP_MEM and op.mem.base == x86.X86_REG_RIP:
            return insn.address + insn.size + op.mem.disp
    return None


def test_the_stub_reads_and_writes_only_the_words_the_recorder_lays_out():
    saved = {mainhold.SAVED_AT + 8 * i for i in range(len(mainhold.SAVED))}
    laid_out = {mainhold.FLAG, mainhold.DONE, mainhold.TARGET, mainhold.HOST_PID}
    laid_out |= {mainhold.COUNTDOWN, mainhold.TV_SEC, mainhold.TV_USEC, mainhold.AREA} | saved
    touched = {at for i in stub_instructions() if (at := rip_relative(i)) is not None}
    assert touched == laid_out
    assert mainhold.AREA % 64 == 0  # XRSTOR's alignment
    assert max(laid_out - {mainhold.AREA}) + 8 <= mainhold.AREA
    assert len(mainhold.STUB) <= mainhold.FLAG


def test_the_stub_changes_no_flag_and_no_register_it_does_not_put_back():
    insns = stub_instructions()
    for insn in insns:
        if insn.id != x86.X86_INS_SYSCALL:  # which gives the flags back as they were
            assert insn.eflags == 0, f"{insn.mnemonic} {insn.op_str} changes flags"
    written: set[str] = set()
    for insn in insns:
        if insn.id == x86.X86_INS_SYSCALL:
            written |= {"rax", "rcx", "r11"}
        for op in insn.operands:
            if op.type == x86.X86_OP_REG and op.access & capstone.CS_AC_WRITE:
                written.add(insn.reg_name(op.reg))
    widened = {"eax": "rax", "edx": "rdx", "esi": "rsi", "edi": "rdi", "r10d": "r10"}
    assert {widened.get(r, r) for r in written} <= set(mainhold.SAVED)
    assert all(rip_relative(i) != mainhold.AREA or i.id == x86.X86_INS_XRSTOR64 for i in insns)
    assert insns[-1].mnemonic == "jmp" and rip_relative(insns[-1]) == mainhold.TARGET
