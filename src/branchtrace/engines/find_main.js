'use strict';
// Where main is: from the symbol table, or, for a stripped executable, from _start, which
// passes main to __libc_start_main in rdi.  Shared by the agent and bench/record.py.
function findMain() {
  const mod = Process.mainModule;
  const sym = mod.enumerateSymbols().find((s) => s.name === 'main');
  if (sym) {
    return sym.address;
  }
  // Stripped: _start passes main to __libc_start_main in rdi.
  const eEntry = ptr(mod.base.add(0x18).readU64().toString()); // ELF header e_entry
  const entry = eEntry.compare(mod.base) < 0 ? mod.base.add(eEntry) : eEntry; // PIE: relative
  let insn = Instruction.parse(entry);
  for (let i = 0; i < 24 && insn !== null; i++) {
    const ops = insn.operands;
    if (ops.length === 2 && ops[0].type === 'reg' && ops[0].value === 'rdi') {
      if (insn.mnemonic === 'lea' && ops[1].type === 'mem' && ops[1].value.base === 'rip') {
        return insn.next.add(ops[1].value.disp);
      }
      if (insn.mnemonic === 'mov' && ops[1].type === 'imm') {
        return ptr(ops[1].value.toString());
      }
    }
    insn = Instruction.parse(insn.next);
  }
  return null;
}
