'use strict';
// The stalker engine's agent.  Everything per branch happens in the CModule (see
// stalker_agent.c); this script only sets threads up and reports events to the host.
// PARAMS is prepended by the host: {cSource, mainRing, spawn, forkStub, initOffset, park,
// followFork, triggers, snapshots, notesPath, spared, signalLockOffset, holdPage}.

const libc = (name) => Module.getGlobalExportByName(name);
// Where this script's hooks are (leaveStalker).
const hookedAt = [];
let hooksNoted = false; // from the end of the set-up on, each hook added is noted at once
function attach(target, callbacks) {
  hookedAt.push(target);
  const listener = Interceptor.attach(target, callbacks);
  if (hooksNoted) {
    noteHooks();
  }
  return listener;
}
// Asked once per compiled block (never per execution) that starts in neither Frida's agent
// nor a module (is_frida_code in stalker_agent.c): blocks of Frida's own code, such as the
// hook that starts tracing at main, are not the program's and get no record.
const isFridaCode = new NativeCallback((address) => (Cloak.hasRangeContaining(address) ? 1 : 0),
  'int', ['pointer']);
const state = Memory.alloc(8 + 8 * 4096 + 1384); // BtState in stalker_agent.c
state.writeU32(Process.id);
state.add(4).writeS32(0); // no threads yet (Memory.alloc does not promise zeroed memory)
state.add(8 + 8 * 4096).writeU64(0); // the inline cache is not widened yet
state.add(8 + 8 * 4096 + 8).writeU64(0); // no fork held or under way
const PARKED = 8 + 8 * 4096 + 16; // BtState.parked: the parked thread's tid (park)
state.add(PARKED).writeU64(0); // no parked thread (park)
state.add(PARKED + 8).writeU64(0); // no fork() gated or past the gate
state.add(PARKED + 16).writeU32(0); // no thread held where a fork() returns
state.add(PARKED + 20).writeU32(0); // the thread slots are free to take
// Frida's files, which the program's close() and close_range() leave open (on_close_range)
const spared = PARAMS.spared.slice(0, 16); // [fd, isEventfd, id]: BtSpared
state.add(PARKED + 24).writeS32(spared.length);
spared.forEach(([fd, isEventfd, id], i) => {
  const at = state.add(PARKED + 32 + 16 * i);
  at.writeS32(fd);
  at.add(4).writeU32(isEventfd);
  at.add(8).writeU64(uint64(id.toString()));
});
const CODE_MAP = PARKED + 288; // BtState.code_map
state.add(CODE_MAP).writePointer(NULL);
state.add(CODE_MAP + 8).writePointer(NULL); // BtState.stalker: not checked yet
state.add(8 + 8 * 4096 + 824).writePointer(NULL); // BtState.heap_locks: not found yet
state.add(8 + 8 * 4096 + 832).writePointer(NULL);
state.add(8 + 8 * 4096 + 840).writeU64(0); // nobody holds them (heap_locked_by)
state.add(8 + 8 * 4096 + 848).writePointer(NULL); // BtState.signal_lock: not found yet
// BtState.unhook_children: a forked child that is not followed puts back the code the hooks
// changed (leave_parents_trace in stalker_agent.c); 0 under --follow-fork, which
// declines_stub reads too; nhooked_pages: none noted yet
state.add(8 + 8 * 4096 + 856).writeS32(PARAMS.followFork ? 0 : 1);
state.add(8 + 8 * 4096 + 860).writeS32(0);

// /proc/self/maps, or nothing without /proc: Frida's Cloak then answers for the agent's code
// too, as it did for all code, and no heap lock is found (agentData)
function procMaps() {
  try {
    return File.readAllText('/proc/self/maps').split('\n');
  } catch (e) {
    return [];
  }
}
// Frida's agent: the mappings /proc/self/maps names so (Frida hides it from Process'
// modules), merged where they touch.
function agentRanges(perms = '') {
  const ranges = [];
  for (const line of procMaps()) {
    if (line.includes('frida-agent') && line.split(' ')[1].startsWith(perms)) {
      const [start, end] = line.split(' ')[0].split('-').map((x) => uint64('0x' + x));
      const last = ranges[ranges.length - 1];
      if (last !== undefined && last[1].equals(start)) {
        last[1] = end;
      } else {
        ranges.push([start, end]);
      }
    }
  }
  return ranges;
}
const agentCode = agentRanges().map(([start, end]) => [start, end, 1]);
// Every map published stays: a compiling thread may still be reading an earlier one.
const codeMaps = [];
function publishCodeMap() {
  const ranges = Process.enumerateModules()
    .map((m) => [uint64(m.base.toString()), uint64(m.base.add(m.size).toString()), 0])
    .concat(agentCode)
    .sort((a, b) => a[0].compare(b[0]));
  const map = Memory.alloc(8 + 24 * ranges.length); // BtCodeMap
  map.writeU64(ranges.length);
  ranges.forEach(([start, end, fridas], i) => {
    const at = map.add(8 + 24 * i);
    at.writeU64(start);
    at.add(8).writeU64(end);
    at.add(16).writeU64(fridas);
  });
  codeMaps.push(map);
  state.add(CODE_MAP).writePointer(map);
}
const GAP_FORK = 1;
// Threads inside fork(), which Stalker cannot take a thread through (see stalker_agent.c):
// unfollowed on the way in, followed again on the way out, unless they came through the fork
// stub (forkStub), which runs fork() natively anyway.  Every fork() of the traced
// process passes here, followed or not, so that a follow asked for meanwhile (attaching
// while the program forks) waits for the way out instead of following a thread that is
// about to fork: its child would inherit a stalked thread and die.
const inFork = new Set();
const keptInFork = new Set(); // those that came through the stub
const forkEntry = libc('fork');
const beforeFork = new NativeCallback(() => {
  const tid = Process.getCurrentThreadId();
  const t = threads.get(tid);
  if (t !== undefined) {
    const kept = forkKept(t) !== 0;
    if (kept) {
      // the block that reached fork() followed would be its first instruction (the hook's
      // jump): the same record here, so that the trace reads the same either way
      threadBlock(t, forkEntry);
      keptInFork.add(tid);
    }
    threadGap(t, GAP_FORK);
    if (!kept) {
      Stalker.unfollow();
    }
  }
  inFork.add(tid);
}, 'void', []);
const afterFork = new NativeCallback(() => {
  const tid = Process.getCurrentThreadId();
  const t = threads.get(tid);
  const kept = keptInFork.delete(tid);
  // not after stop(), which closed the rings and let go of the threads meanwhile
  if (inFork.delete(tid) && tracing && t !== undefined && !kept) {
    // What Stalker kept for the thread until the unfollow above (its code cache, over a
    // megabyte of mappings) is freed only when asked: else a program grew by 1.3 MB with
    // each fork() (forkmem: 230 MB over 180), and every later fork() copied all of it.
    Stalker.garbageCollect();
    Stalker.follow(tid, { transform: cm.transform, data: t });
  }
}, 'void', []);
// Threads inside a fork() that began before the fork hook was in place (attaching): tid ->
// null while the host waits for it to come out (bt_on_fork_return), or why it cannot be seen
// coming out (findForksBegunBefore).
const forksBegunBefore = new Map();
// Those of them still inside fork() as tracing starts: tid -> ring, followed when that fork()
// returns to its caller.
const returning = new Map();
// Those that came out as the host got ready to follow the threads, and wait for their ring
// (bt_on_fork_return).
const outOfFork = new Set();
// 1: the thread is to wait until the host has followed the threads, then come back here
const forkReturned = new NativeCallback(() => {
  const tid = Process.getCurrentThreadId();
  const awaited = forksBegunBefore.get(tid) === null;
  forksBegunBefore.delete(tid);
  const path = returning.get(tid);
  if (path !== undefined) {
    returning.delete(tid);
    if (tracing) {
      follow(tid, path);
    }
    return 0;
  }
  if (awaited && !tracing) {
    outOfFork.add(tid);
    return 1;
  }
  return 0;
}, 'int', []);
// A thread that ends, and exit(), run __call_tls_dtors, where Frida's thread registry takes
// the calling thread for one that ends, and Stalker lets go of it: followed again there
// (bt_on_tls_dtors), with the ring it has, as the rest is the program's code too.  Not once
// tracing has stopped: this script is on its way out then.
const followAgain = new NativeCallback(() => {
  const tid = Process.getCurrentThreadId();
  const t = threads.get(tid);
  if (t !== undefined && tracing) {
    Stalker.follow(tid, { transform: cm.transform, data: t });
  }
}, 'void', []);
// A thread renewing its Stalker context (renew_context in stalker_agent.c), native in its
// refollow stub's hook: two calls, as Stalker's unfollow and follow of the calling thread
// take effect as the call returns, and one call asking both would do neither.
const unfollowMe = new NativeCallback(() => {
  Stalker.unfollow();
}, 'void', []);
const followAfresh = new NativeCallback(() => {
  const tid = Process.getCurrentThreadId();
  const t = threads.get(tid);
  Stalker.garbageCollect();
  if (t !== undefined && tracing) {
    Stalker.follow(tid, { transform: cm.transform, data: t });
  }
}, 'void', []);
const hookedHandlers = new Set();
// What it hooked (note_handler in stalker_agent.c waits for those hooks to be in the code):
// 1 the handler, 2 the restorer too.
const newHandler = new NativeCallback((handler) => {
  const key = handler.toString();
  if (hookedHandlers.has(key)) {
    return 0;
  }
  const first = hookedHandlers.size === 0;
  if (first) {
    hookHandlerExits();
  }
  hookedHandlers.add(key);
  attach(handler, cm.bt_on_handler_entry);
  return first ? 3 : 1;
}, 'int', ['pointer']);
// A handler left by a jump rather than a return (bt_on_longjmp in stalker_agent.c): hooked
// once the program sets a handler, as each hook costs every thread a stop by Gum at the end
// (letGoOfAll).
function hookHandlerExits() {
  const restorer = new NativeFunction(cm.bt_fault_restorer, 'pointer', [])();
  if (!restorer.isNull()) {
    attach(restorer, cm.bt_on_sigreturn);
  }
  const jumps = new Set();
  for (const name of ['siglongjmp', 'longjmp', '_longjmp', '__longjmp_chk']) {
    const f = Module.findGlobalExportByName(name);
    if (f !== null && !jumps.has(f.toString())) {
      jumps.add(f.toString());
      attach(f, cm.bt_on_longjmp);
    }
  }
}
// A thread whose signal handler moved its pc on (bt_on_sigreturn in stalker_agent.c), or
// that takes a fresh Stalker context (put_renewal), goes through a stub of its own: it saves
// the thread's vector and x87 state (XSAVE, else FXSAVE) and the registers that takes, steps
// below the red zone, runs 16 nops that the hook takes, puts all back and jumps to the target
// the agent writes in the next page (the code's page is not writable, for systems that
// refuse memory both writable and executable).  The hook's listener runs C, JavaScript and
// libc's AVX routines, and pushes onto the stack, and a thread may be sent there from any
// block: renewed inside libc's strchrnul(), printf() printed its format ("%d") instead of
// the number, and a leaf function's locals under its stack pointer were overwritten.
// Mapped for good (a thread may be on its way there as this script unloads; the stub then
// just jumps) and cloaked: its code is not the program's and gets no record.
const REFOLLOW_HOOK = 80; // BT_REFOLLOW_HOOK in stalker_agent.c
const xsave = /^flags\s*:.*\bxsave\b/m.test(File.readAllText('/proc/cpuinfo'));
const newRefollow = new NativeCallback(() => {
  const mmap = new NativeFunction(libc('mmap'), 'pointer',
    ['pointer', 'size_t', 'int', 'int', 'int', 'int64']);
  const page = 4096; // BT_REFOLLOW_TARGET: the target, then rax, rcx, rdx, the saved state
  const stub = mmap(NULL, 2 * page, 3 /* RW */, 0x22 /* PRIVATE|ANONYMOUS */, -1, 0);
  if (stub.equals(ptr(-1))) {
    return NULL;
  }
  const code = [];
  const ripTo = (offset, length) => { // disp32 of [rip + disp] to page + offset
    const disp = page + offset - (code.length + length);
    code.push(disp & 0xff, (disp >> 8) & 0xff, (disp >> 16) & 0xff, (disp >> 24) & 0xff);
  };
  const saving = (rmByte) => {
    code.push(0x48, 0x89, 0x05); ripTo(8, 4); // mov [rip+..], rax
    code.push(0x48, 0x89, 0x0d); ripTo(16, 4); // mov [rip+..], rcx
    code.push(0x48, 0x89, 0x15); ripTo(24, 4); // mov [rip+..], rdx
    code.push(0x48, 0x8d, 0x0d); ripTo(64, 4); // lea rcx, [rip+..]: the state, 64-aligned
    // x87, SSE, AVX, AVX-512 (not AMX's tiles, which would not fit)
    code.push(0xb8, 0xe7, 0, 0, 0, 0xba, 0, 0, 0, 0); // mov eax, 0xe7; mov edx, 0
    code.push(0x48, 0x0f, 0xae, rmByte); // xsave64/xrstor64 or fxsave64/fxrstor64 [rcx]
    code.push(0x48, 0x8b, 0x05); ripTo(8, 4); // mov rax, [rip+..]
    code.push(0x48, 0x8b, 0x0d); ripTo(16, 4);
    code.push(0x48, 0x8b, 0x15); ripTo(24, 4);
  };
  saving(xsave ? 0x21 : 0x01);
  // below the red zone: a thread may be sent here from inside a leaf function, whose locals
  // lie under its stack pointer, and the hook pushes onto the stack (as the kernel skips it)
  code.push(0x48, 0x8d, 0x64, 0x24, 0x80); // lea rsp, [rsp - 128]
  while (code.length < REFOLLOW_HOOK + 16) {
    code.push(0x90);
  }
  code.push(0x48, 0x8d, 0xa4, 0x24, 0x80, 0, 0, 0); // lea rsp, [rsp + 128]
  saving(xsave ? 0x29 : 0x09);
  code.push(0xff, 0x25); ripTo(0, 4); // jmp qword [rip+..]: the target
  stub.writeByteArray(code);
  if (!Memory.protect(stub, page, 'r-x')) {
    return NULL;
  }
  Cloak.addRange({ base: stub, size: 2 * page });
  attach(stub.add(REFOLLOW_HOOK), cm.bt_on_refollow);
  return stub;
}, 'pointer', []);
// The signal stub: the kernel's handler for the signals whose handlers the program set
// (bt_signal_enter in stalker_agent.c), with its data in the next page: bt_signal_enter's
// address (0 once the recording has ended: the handler then runs natively), a magic, a
// `ret` of the stub's, the restorer's system call (found later), the stub's way back to the
// kernel without the handler, and the program's handler for each signal.  Mapped for good, as the
// refollow stub: a signal may be on its way there as this script unloads.
const sigStub = (() => {
  const mmap = new NativeFunction(libc('mmap'), 'pointer',
    ['pointer', 'size_t', 'int', 'int', 'int', 'int64']);
  const page = 4096;
  const stub = mmap(NULL, 2 * page, 3 /* RW */, 0x22 /* PRIVATE|ANONYMOUS */, -1, 0);
  if (stub.equals(ptr(-1))) {
    throw new Error('no memory for the signal stub');
  }
  const code = [];
  const ripTo = (target, length) => { // disp32 of [rip + disp] to stub + target
    const disp = target - (code.length + length);
    code.push(disp & 0xff, (disp >> 8) & 0xff, (disp >> 16) & 0xff, (disp >> 24) & 0xff);
  };
  // (what the first instructions push is known to interrupted_frame: keep them in step)
  code.push(0x48, 0x83, 0xec, 0x10); // sub rsp, 16: out[2], where the stub goes and the handler
  code.push(0x57, 0x56, 0x52); // push rdi; push rsi; push rdx (the stack is 16-aligned now)
  code.push(0x48, 0x8d, 0x4c, 0x24, 0x18); // lea rcx, [rsp+24]: out
  code.push(0x48, 0x8b, 0x05); ripTo(page, 4); // mov rax, [bt_signal_enter]
  code.push(0x48, 0x85, 0xc0, 0x74, 0x08); // test rax, rax; jz native
  code.push(0xff, 0xd0); // call rax
  code.push(0x5a, 0x5e, 0x5f, 0x31, 0xc0, 0xc3); // pop rdx; pop rsi; pop rdi; xor eax, eax; ret
  code.push(0x5a, 0x5e, 0x5f); // native: pop rdx; pop rsi; pop rdi
  code.push(0x48, 0x8d, 0x05); const nativeRetFixup = code.length; ripTo(0, 4); // lea rax, [ret]
  code.push(0x48, 0x89, 0x04, 0x24); // mov [rsp], rax
  code.push(0x48, 0x8d, 0x05); ripTo(page + 64, 4); // lea rax, [handlers]
  code.push(0x48, 0x8b, 0x04, 0xf8); // mov rax, [rax + rdi*8]
  code.push(0x48, 0x89, 0x44, 0x24, 0x08, 0x31, 0xc0, 0xc3); // mov [rsp+8], rax; xor eax, eax; ret
  const nativeRet = code.length;
  code.push(0xc3);
  // a held signal (hold_signal): past the restorer's address, straight to rt_sigreturn
  const skip = code.length;
  code.push(0x48, 0x83, 0xc4, 0x08, 0xb8, 0x0f, 0, 0, 0, 0x0f, 0x05); // add rsp, 8; mov eax, 15; syscall
  const disp = nativeRet - (nativeRetFixup + 4);
  code.splice(nativeRetFixup, 4, disp & 0xff, (disp >> 8) & 0xff, (disp >> 16) & 0xff,
    (disp >> 24) & 0xff);
  stub.writeByteArray(code);
  stub.add(page + 8).writeU64(uint64('0x6274736967737462'));
  stub.add(page + 16).writePointer(stub.add(nativeRet));
  stub.add(page + 32).writePointer(stub.add(skip));
  if (!Memory.protect(stub, page, 'r-x')) {
    throw new Error('the signal stub cannot be made executable');
  }
  Cloak.addRange({ base: stub, size: 2 * page });
  return stub;
})();
// record --trigger: the thread that reaches a trigger waits while the host copies the rings,
// so its snapshot ends exactly there.  The agent's transform puts a callout before the
// trigger's instruction (on_trigger in stalker_agent.c), which calls triggerReached.
const triggerTable = Memory.alloc(8 * (1 + 2 * PARAMS.triggers.length)); // bt_triggers
let triggersPlaced = 0;
for (const [index, trigger] of PARAMS.triggers.entries()) {
  const module = Process.enumerateModules().find((m) => m.path === trigger.path);
  if (module === undefined) {
    send({ type: 'error', message: `trigger ${trigger.label}: ${trigger.path} is not loaded` });
    continue;
  }
  triggerTable.add(8 * (1 + 2 * triggersPlaced)).writePointer(module.base.add(trigger.offset));
  triggerTable.add(8 * (2 + 2 * triggersPlaced)).writeU64(index);
  triggersPlaced += 1;
}
triggerTable.writeU64(triggersPlaced);
let snapshotsLeft = PARAMS.snapshots;
// (`tracing` is set further down, before any thread is followed)
const triggerReached = new NativeCallback((index) => {
  if (!tracing || snapshotsLeft <= 0 || !inTracedProcess()) return;
  snapshotsLeft -= 1;
  const tid = Process.getCurrentThreadId();
  send({ type: 'trigger', index: Number(index), tid });
  recv(`snapshot:${tid}`, () => {}).wait();
}, 'void', ['uint64']);
const readers = Memory.alloc(8 * (2 * 8 + 1)); // bt_readers (bt_disassemble_at)
readers.writeByteArray(new Array(8 * (2 * 8 + 1)).fill(0));
const cm = new CModule(PARAMS.cSource, {
  bt_is_frida_code: isFridaCode,
  bt_new_handler: newHandler,
  bt_notes_path: Memory.allocUtf8String(PARAMS.notesPath),
  bt_state: state,
  bt_before_fork: beforeFork,
  bt_after_fork: afterFork,
  bt_fork_returned: forkReturned,
  bt_follow_again: followAgain,
  bt_unfollow_me: unfollowMe,
  bt_follow_afresh: followAfresh,
  bt_new_refollow: newRefollow,
  bt_sigstub: sigStub,
  bt_trigger_reached: triggerReached,
  bt_triggers: triggerTable,
  bt_readers: readers,
  fork: libc('fork'), open: libc('open'), close: libc('close'), fcntl: libc('fcntl'),
  lseek: libc('lseek'), mmap: libc('mmap'), munmap: libc('munmap'), getpid: libc('getpid'),
  syscall: libc('syscall'), clock_gettime: libc('clock_gettime'), memset: libc('memset'),
  strlen: libc('strlen'), sigaction: libc('sigaction'),
  __errno_location: libc('__errno_location'),
});
const getpid = new NativeFunction(libc('getpid'), 'int', []);
// A fault (SIGSEGV, SIGBUS, SIGILL, SIGFPE, abort()) names the program's instruction in the
// trace (FAULT records, write_fault in stalker_agent.c) until the end (finish).
const releaseFaults = new NativeFunction(cm.bt_release_faults, 'void', []);
new NativeFunction(cm.bt_catch_faults, 'void', [])();
// What the host reads only at the end goes to a file, one JSON object a line (bt_note), rather
// than into a message: with --follow-fork a message still on its way when the program forks
// kills the child or leaves it stuck (its Frida delivers it over the parent's connection,
// which it has dropped), and every fork() starts a thread of Frida's that would be reported
// so.  The C side notes the inline cache itself.
const btNote = new NativeFunction(cm.bt_note, 'void', ['pointer']);
const note = (event) => btNote(Memory.allocUtf8String(`${JSON.stringify(event)}\n`));
// Gum's one-instruction disassembler, which Stalker calls for every link it makes between
// two blocks, opens a capstone handle each time (bt_disassemble_at in stalker_agent.c):
// replaced by the agent's, which keeps a few open, when it is found where Gum's capstone is
// (the agent's code is cloaked: /proc/self/maps names it).  Its first 14 bytes become a
// jump through a page of the agent's (bt_gum_reader_install).  With Interceptor.replace()
// instead the program died (SIGSEGV, `python3 -c pass`).
let gumReaderMatch = null, gumReaderScanned = false; // findGumReader
const gumReader = (() => {
  const install = new NativeFunction(cm.bt_gum_reader_install, 'int', ['pointer', 'pointer']);
  const inherited = new NativeFunction(cm.bt_gum_reader_inherited, 'pointer', [])();
  const found = inherited.isNull() ? findGumReader() : [inherited];
  if (found.length !== 1) return false;
  const patch = Memory.alloc(14);
  const how = install(found[0], patch);
  if (how === 1) {
    Memory.patchCode(found[0], 14, (code) => code.writeByteArray(patch.readByteArray(14)));
  }
  return how >= 0;
})();
// every executable mapping of the file Gum's capstone is in: a page patched before (in a
// forked child, by the parent's recording) is a mapping of its own.  That scan took 16-29
// ms of each agent's start, so the first process's match, as an offset from the agent's
// start (gumReaderMatch), is handed to the recording's next ones (PARAMS.gumReaderMatch),
// which check the code there as the scan's matches are checked.
function findGumReader() {
  const csOpen = new NativeFunction(cm.bt_cs_open, 'pointer', [])();
  const gumReaderAt = new NativeFunction(cm.bt_gum_reader_at, 'pointer', ['pointer']);
  const maps = File.readAllText('/proc/self/maps').split('\n').map((line) => {
    const [range, perms, , , , path] = line.split(/ +/);
    const [start, end] = (range || '0-0').split('-').map((x) => ptr(`0x${x}`));
    return { start, end, perms: perms || '', path };
  });
  const home = maps.find((m) => csOpen.compare(m.start) >= 0 && csOpen.compare(m.end) < 0);
  if (home === undefined || home.path === undefined || agentCode.length === 0) return [];
  const code = maps.filter((m) => m.path === home.path && m.perms.includes('x'));
  const agentStart = ptr('0x' + agentCode[0][0].toString(16));
  if (PARAMS.gumReaderMatch !== null) {
    const match = agentStart.add(PARAMS.gumReaderMatch);
    // bt_gum_reader_at reads up to 135 bytes from the match on
    const inCode = code.some((m) => match.compare(m.start) >= 0 && match.add(160).compare(m.end) <= 0);
    const reader = inCode ? gumReaderAt(match) : NULL;
    if (!reader.isNull()) {
      gumReaderMatch = PARAMS.gumReaderMatch;
      return [reader];
    }
  }
  gumReaderScanned = true;
  const found = code.flatMap((m) => Memory.scanSync(m.start, m.end.sub(m.start).toUInt32(),
    'be 08 00 00 00 bf 03 00 00 00 e8'))
    .map((match) => [match.address, gumReaderAt(match.address)]).filter(([, f]) => !f.isNull());
  if (found.length === 1) {
    gumReaderMatch = found[0][0].sub(agentStart).toInt32();
  }
  return found.map(([, f]) => f);
}
const restoreGumReader = new NativeFunction(cm.bt_gum_reader_restore, 'void', []);
note({ type: 'gum-reader', found: gumReader });
// false in a forked child that Frida's child gating keeps this script alive in
const inTracedProcess = () => getpid() === state.readU32();
const threadAlloc = new NativeFunction(cm.bt_thread_alloc, 'pointer', []);
const threadOpen = new NativeFunction(cm.bt_thread_open, 'int', ['pointer', 'pointer', 'uint32']);
const threadClose = new NativeFunction(cm.bt_thread_close, 'void', ['pointer', 'int64']);
const closeDeadline = new NativeFunction(cm.bt_close_deadline, 'int64', []);
const threadLetGo = new NativeFunction(cm.bt_thread_let_go, 'int', ['pointer']);
const threadAsleepAt = new NativeFunction(cm.bt_thread_asleep_at, 'uint64', ['pointer']);
const threadAltstack = new NativeFunction(cm.bt_thread_altstack, 'uint64', ['pointer']);
const threadLetGoAsleep = new NativeFunction(cm.bt_thread_let_go_asleep, 'int',
  ['pointer', 'int', 'int']);
const threadGap = new NativeFunction(cm.bt_thread_gap, 'void', ['pointer', 'uint32']);
const threadBlock = new NativeFunction(cm.bt_thread_block, 'void', ['pointer', 'pointer']);
const threadFarBlocks = new NativeFunction(cm.bt_thread_far_blocks, 'uint64', ['pointer']);
const holdRenewals = new NativeFunction(cm.bt_hold_renewals, 'int', []);
const holdForks = new NativeFunction(cm.bt_hold_forks, 'int', ['int']);
const holdForksAtEntry = new NativeFunction(cm.bt_hold_forks_at_entry, 'int', ['int']);
const forkTurns = new NativeFunction(cm.bt_fork_turns, 'void', ['int']);
forkTurns(0); // not yet (see takeTurns)
// A new thread holds its fork turn (bt_thread_turn) while it runs this script: taken
// without the script's lock (the default, cooperative, lets go of it while the call waits),
// given back with it held, so a fork() that takes the turn next waits for the lock too
// (bt_before_fork) until the thread is out of the script.  A message sent while a fork() is
// under child gating is delivered in the child too, which dies of it (docs/fork.md section
// 2): so the thread's messages wait for the turn as well.
const threadTurn = new NativeFunction(cm.bt_thread_turn, 'int', ['pointer']);
const giveForkTurn = new NativeFunction(cm.bt_give_fork_turn, 'void', [],
  { scheduling: 'exclusive' });
const forksInFlight = new NativeFunction(cm.bt_forks_in_flight, 'int', []);
const forkKept = new NativeFunction(cm.bt_thread_fork_kept, 'int', ['pointer']);
// A program built with -fno-plt calls fork() through its .got entry (R_X86_64_GLOB_DAT), for
// which Frida reports no import slot: found by the address the dynamic linker wrote there,
// once, before anything here writes another.
function gotSlotsHolding(target) {
  const slots = [];
  for (const module of Process.enumerateModules()) {
    let sections = [];
    try {
      sections = module.enumerateSections();
    } catch (e) {
      continue; // its calls of fork() take the hook's way
    }
    for (const section of sections) {
      if (section.name !== '.got') {
        continue;
      }
      for (let at = 0; at + Process.pointerSize <= section.size; at += Process.pointerSize) {
        if (section.address.add(at).readPointer().equals(target)) {
          slots.push(section.address.add(at));
        }
      }
    }
  }
  return slots;
}
const forkGotSlots = gotSlotsHolding(libc('fork'));
// The GOT slots the program's calls of fork() go through: its PLT's (modules loaded since
// too) and those of -fno-plt code; each once, as gateForks saves what a slot holds before
// it writes the gate there.
// Writes `value` into the GOT slot `slot`, whose page may be read-only (RELRO): what the slot
// held, or null if it could not.
function writeSlot(slot, value) {
  const range = Process.findRangeByAddress(slot);
  if (range === null || !Memory.protect(slot, Process.pointerSize, 'rw-')) {
    return null;
  }
  const held = slot.readPointer();
  slot.writePointer(value);
  Memory.protect(slot, Process.pointerSize, range.protection);
  return held;
}
function forkCallSlots() {
  const slots = new Map(forkGotSlots.map((slot) => [slot.toString(), slot]));
  for (const module of Process.enumerateModules()) {
    for (const imported of module.enumerateImports()) {
      if (imported.name === 'fork' && imported.slot) {
        slots.set(imported.slot.toString(), imported.slot);
      }
    }
  }
  return [...slots.values()];
}
// A followed thread that calls fork() is unfollowed in its hook and followed again after
// it (beforeFork), and Stalker then compiles for it anew all the code it runs: a shell, its
// loop after every subshell (bash, 500 subshells: 18 s, against 0.25 s untraced).  A call
// to code Stalker leaves out (Stalker.exclude) runs natively and comes back to what Stalker
// had compiled.  So the program's calls of fork() through its GOT go through this stub:
// `outer`, followed, calls `inner`, left out, which marks the thread for the hook
// (bt_fork_mark) and calls fork() (bash: 2.4 s).  In the child, `inner` returns to `outer`
// itself, not to the parent's compiled code, which the child must never run.  The stub is
// mapped for good and calls through slots: at the end (unkeepForks), and in a child, the
// mark's slot points at a `ret`, so nothing comes through it into this script's code once
// it may be unloaded; in a program attached to, the GOT keeps pointing at it after the
// detach.  Not in a forked child (PARAMS.forkStub): it goes on through its parent's copy,
// whose `inner` the child's script leaves out as well and whose mark slot it points at
// bt_fork_first (inheritedForkSlots, forkDoneLast).
const forkSlots = new NativeFunction(libc('mmap'), 'pointer',
  ['pointer', 'size_t', 'int', 'int', 'int', 'int64'])(NULL, 2 * Process.pageSize,
  3 /* RW */, 0x22 /* PRIVATE|ANONYMOUS */, -1, 0);
const forkStub = forkSlots.equals(ptr(-1)) || !PARAMS.forkStub ? null
  : forkSlots.add(Process.pageSize);
const MARK_SLOT = 0;
const FORK_SLOT = 8;
const NOOP_SLOT = 16; // the stub's `ret`, for a forked child's script (inheritedForkSlots)
const MAGIC_SLOT = 24; // this page is the slots of a stub of ours
const STUB_MAGIC = uint64('0x6275747326666f72');
const DECLINED = -2; // `inner` did not fork (the mark said so): no pid fork() returns
let forkStubNoop = NULL;
if (forkStub !== null) {
  forkSlots.add(MARK_SLOT).writePointer(cm.bt_fork_mark);
  forkSlots.add(FORK_SLOT).writePointer(libc('fork'));
  const w = new X86Writer(forkStub, { pc: forkStub });
  const callSlot = (offset) => {
    w.putMovRegAddress('rax', forkSlots.add(offset));
    w.putMovRegRegPtr('rax', 'rax');
    w.putCallReg('rax');
  };
  // outer: followed; 16-byte aligned stack at `inner`'s calls
  w.putSubRegImm('rsp', 8);
  const inner = forkStub.add(64);
  w.putCallAddress(inner);
  const outerAfter = forkStub.add(w.offset);
  w.putCmpRegI32('eax', DECLINED);
  w.putJccShortLabel('jne', 'forked', 'no-hint');
  callSlot(FORK_SLOT); // the mark declined: fork() called followed, the hook's way
  w.putLabel('forked');
  w.putAddRegImm('rsp', 8);
  w.putRet();
  forkStubNoop = forkStub.add(w.offset);
  forkSlots.add(NOOP_SLOT).writePointer(forkStubNoop);
  forkSlots.add(MAGIC_SLOT).writeU64(STUB_MAGIC);
  w.putMovRegU32('eax', 1); // a mark that keeps the thread followed
  w.putRet();
  w.flush();
  w.reset(inner);
  w.putPushReg('rbx');
  callSlot(MARK_SLOT);
  w.putTestRegReg('eax', 'eax');
  w.putJccShortLabel('je', 'declined', 'no-hint');
  callSlot(FORK_SLOT);
  w.putMovRegReg('ebx', 'eax');
  w.putTestRegReg('eax', 'eax');
  w.putJccShortLabel('jne', 'parent', 'no-hint');
  w.putMovRegAddress('rax', outerAfter); // the child goes on natively
  w.putMovRegOffsetPtrReg('rsp', 8, 'rax');
  w.putLabel('parent');
  w.putMovRegReg('eax', 'ebx');
  w.putPopReg('rbx');
  w.putRet();
  w.putLabel('declined');
  w.putMovRegU32('eax', DECLINED);
  w.putPopReg('rbx');
  w.putRet();
  w.flush();
  Memory.protect(forkStub, Process.pageSize, 'r-x');
  Cloak.addRange({ base: forkSlots, size: 2 * Process.pageSize });
  Stalker.exclude({ base: inner, size: Process.pageSize - 64 });
}
// Only once the fork() hook is in place (below): a fork() entered through the stub before
// that passes no hook, and a thread found inside it as tracing starts was taken for one
// inside the hook's trampoline (the stub is cloaked, as that is), followed there from
// outside, and its child died -- attached to slowfork, 1 run in 10-30 lost a child so.
function routeForksThroughStub() {
  if (forkStub === null) {
    return;
  }
  for (const slot of forkCallSlots()) {
    writeSlot(slot, forkStub); // else its fork() calls take the hook's way
  }
}
// A forked child's copy of its parent's stub, which its fork() calls through the GOT go
// through: the slots' page (the page before the stub, marked as ours), found from a GOT slot
// of fork(), or null.  Its mark may still be the parent's bt_fork_first as this script
// loads: a parent that is a forked child itself puts the `ret` back in its leave listener,
// which runs after Frida's, which holds the child for this script (bt_on_fork_leave).
function inheritedForkSlots() {
  if (forkStub !== null) {
    return null;
  }
  for (const slot of forkCallSlots()) {
    try {
      const stub = slot.readPointer();
      const slots = stub.sub(Process.pageSize);
      if (stub.and(Process.pageSize - 1).isNull()
          && slots.add(MAGIC_SLOT).readU64().equals(STUB_MAGIC)
          && slots.add(FORK_SLOT).readPointer().equals(libc('fork'))) {
        return slots;
      }
    } catch (e) {
      // not the stub: a slot in a module unmapped meanwhile, or one holding fork() itself
    }
  }
  return null;
}
const parentsForkSlots = inheritedForkSlots();
// the stub the program's fork() calls go through: this script's, or the parent's copy
const stubInUse = forkStub !== null ? forkStub
  : parentsForkSlots === null ? null : parentsForkSlots.add(Process.pageSize);
if (parentsForkSlots !== null) { // its `inner`, as the parent's script left it out
  Stalker.exclude({ base: stubInUse.add(64), size: Process.pageSize - 64 });
}
const markSlot = forkStub !== null ? forkSlots.add(MARK_SLOT)
  : parentsForkSlots === null ? NULL : parentsForkSlots.add(MARK_SLOT);
const markNoop = forkStub !== null ? forkStubNoop
  : parentsForkSlots === null ? NULL : parentsForkSlots.add(NOOP_SLOT).readPointer();
// BtState.fork_mark_slot and fork_noop (NULL: no stub, every fork() takes the hook's way)
state.add(8 + 8 * 4096 + 784).writePointer(markSlot);
state.add(8 + 8 * 4096 + 792).writePointer(markNoop);
function unkeepForks() {
  if (!markSlot.isNull()) {
    markSlot.writePointer(markNoop);
  }
}
const pthreadCreate = new NativeFunction(libc('pthread_create'), 'int',
  ['pointer', 'pointer', 'pointer', 'pointer']);
const pthreadDetach = new NativeFunction(libc('pthread_detach'), 'int', ['pointer']);
const pthreadSigmask = new NativeFunction(libc('pthread_sigmask'), 'int',
  ['int', 'pointer', 'pointer']);
// Stalker follows, lets go of and invalidates another thread through Gum's helper: a clone
// of this thread, sharing the program's memory and signal handlers, on an 8 KiB stack, that
// ptraces the thread.  Each ptrace stop sends the helper a SIGCHLD: a program that handles
// SIGCHLD (a shell, a server reaping its children) ran its handler there, overflowed that
// stack, and the helper died, leaving this script waiting for it for good and the program
// stuck (tests/programs/sigchld.c: 4 attaches of 4).  The helper inherits this thread's
// signal mask.
const allSignals = Memory.alloc(128); // sigset_t
for (let i = 0; i < 128; i += 8) {
  allSignals.add(i).writeU64(uint64('0xffffffffffffffff'));
}
function withSignalsBlocked(f) {
  const before = Memory.alloc(128);
  pthreadSigmask(0 /* SIG_BLOCK */, allSignals, before);
  try {
    return f();
  } finally {
    pthreadSigmask(2 /* SIG_SETMASK */, before, NULL);
  }
}
const syscall3 = new NativeFunction(libc('syscall'), 'long', ['long', '...', 'pointer', 'int', 'int']);
const holdReturns = new NativeFunction(cm.bt_hold_returns, 'void', ['int']);

// --follow-fork: every child Frida holds inherits this script, and Frida in the child closes
// it once nothing holds it there; the close reaches the host under the session id the child
// inherited, which is ours, and the host then drops our session with the traced process
// (reason "application-requested") and unloads the agent from it.  A thread of ours parked
// inside a function hooked by this script with a leave listener holds the hook's use count
// at one, and a forked child copies that count without the thread: in the child the hook
// can never be freed, and while any hook waits to be freed Gum has every closing script
// wait, so no script there finishes closing -- nor in a grandchild, which inherits the
// count too, so a child's own agent parks nothing.  (A spawned program, its main thread
// inside main() through the hook that starts tracing, was so protected by chance while
// main() ran.)  Parked before any fork is traced: before tracing starts, so the thread
// observer passes it by.
// The parked thread's code, its listener and its words are in pages of their own, never
// freed: nobody waits for it to end (a fork under way can hold up its exit), so nothing
// orders its way out, once let go, before Frida unloads this script and frees the CModule
// (and with it code it used to wait in).
const mmap = new NativeFunction(libc('mmap'), 'pointer',
  ['pointer', 'size_t', 'int', 'int', 'int', 'long']);
const parkingCode = () => {
  const page = mmap(NULL, 8192, 3 /* PROT_READ|PROT_WRITE */, 0x22 /* MAP_PRIVATE|ANONYMOUS */,
    -1, 0);
  if (page.equals(ptr(-1))) {
    return null;
  }
  const words = page.add(4096); // u32: it may return; s32: its tid, once it waits
  const w = new X86Writer(page);
  w.putNopPadding(16); // room for the hook's jump
  w.putMovRegU32('eax', 186); // gettid
  w.putBytes([0x0f, 0x05]); // syscall
  w.putMovRegOffsetPtrReg('rdi', 4, 'eax');
  w.putLabel('wait');
  w.putMovRegRegOffsetPtr('eax', 'rdi', 0);
  w.putTestRegReg('eax', 'eax');
  w.putJccShortLabel('jne', 'return', 'no-hint');
  w.putXorRegReg('esi', 'esi'); // FUTEX_WAIT
  w.putXorRegReg('edx', 'edx'); // while the word is 0
  w.putMovRegU64('r10', 0); // for good
  w.putMovRegU32('eax', 202); // futex
  w.putBytes([0x0f, 0x05]); // syscall
  w.putJmpShortLabel('wait');
  w.putLabel('return');
  w.putXorRegReg('eax', 'eax');
  w.putRet();
  const listener = page.add(w.offset);
  w.putRet();
  w.flush();
  Memory.protect(page, 4096, 'r-x');
  return { start: page, listener, words };
};
let parking = null;
function park() {
  if (!PARAMS.park || parking !== null || !inTracedProcess()) {
    return;
  }
  const code = parkingCode();
  if (code === null) {
    send({ type: 'error', message: "no memory for the agent's parked thread" });
    return;
  }
  Interceptor.attach(code.start, { onEnter: code.listener, onLeave: code.listener });
  const handle = Memory.alloc(8);
  // with every signal blocked, inherited: the program's handlers never run on it
  const rc = withSignalsBlocked(() => pthreadCreate(handle, NULL, code.start, code.words));
  if (rc !== 0) {
    send({ type: 'error', message: `cannot start the agent's parked thread (error ${rc})` });
    return;
  }
  pthreadDetach(handle.readPointer());
  parking = code;
  while (code.words.add(4).readS32() === 0) {
    Thread.sleep(0.0005);
  }
  state.add(PARKED).writeS32(code.words.add(4).readS32());
}
function release() {
  if (parking !== null) {
    parking.words.writeU32(1);
    syscall3(202 /* futex */, parking.words, 1 /* FUTEX_WAKE */, 1);
    parking = null;
  }
}

const threads = new Map(); // tid -> BtThread* of the last thread with that id
let farOfEarlier = 0; // blocks not traced by threads whose id a later thread got
let tracing = false;

const strerror = new NativeFunction(libc('strerror'), 'pointer', ['int']);
function openRing(tid, path) {
  const t = threadAlloc();
  const rc = threadOpen(t, Memory.allocUtf8String(path), tid);
  if (rc !== 0) {
    const why = rc === -100000 ? 'more than 4096 threads at once' : strerror(-rc).readUtf8String();
    send({ type: 'ring-not-opened', tid, path, why });
    return null;
  }
  const earlier = threads.get(tid);
  if (earlier !== undefined) {
    farOfEarlier += threadFarBlocks(earlier).toNumber();
  }
  threads.set(tid, t);
  return t;
}

// `hooked`: the thread is in a hook of ours at the start of that function, whose first
// instructions run relocated in Frida's code: the trace starts with the function's first
// instruction as a block of its own (the decoder knows the rest of them ran).
function follow(tid, path, hooked = null) {
  const t = openRing(tid, path);
  if (t !== null && hooked !== null) {
    threadBlock(t, hooked);
  }
  if (t !== null && !inFork.has(tid)) { // else afterFork follows it
    Stalker.follow(tid, { transform: cm.transform, data: t });
  }
}

// Rings the host made ahead for this process's next threads (_Recording._hand in
// stalker.py), once one thread has started: a new thread takes one and names it its own,
// without waiting for the host.  Asking the host took 1.3-2.9 ms of the 5.5 ms a thread's
// start cost.
const spares = [];
function takeSpare(m) {
  spares.push(m.path);
  // Stalker frees what it kept for a thread that died followed (they all do: see
  // followAgain) only when asked to collect; else a program that starts and ends threads
  // grows by over half a megabyte each (1,000 threads: 780 MB resident, 200 MB with this).
  // Here, on the script's own thread, the new thread does not wait for it (0.3 ms).
  Stalker.garbageCollect();
  recv('spare', takeSpare);
}
recv('spare', takeSpare);
// renameat2(RENAME_NOREPLACE): a name already taken (a thread that had the id earlier in
// the recording) is left alone
const renameSyscall = new NativeFunction(libc('syscall'), 'long',
  ['long', '...', 'int', 'pointer', 'int', 'pointer', 'uint']);
function renameNoReplace(from, to) {
  return renameSyscall(316, -100 /* AT_FDCWD */, Memory.allocUtf8String(from),
    -100, Memory.allocUtf8String(to), 1).toNumber() === 0;
}

function followNewThread() {
  const tid = Process.getCurrentThreadId();
  const handed = spares.shift();
  if (handed === undefined) {
    askForRing(tid);
    return;
  }
  const t = openRing(tid, handed);
  if (t === null) {
    return; // said why; the recorder takes the ring back at the end
  }
  const own = handed.slice(0, handed.lastIndexOf('/') + 1) + `T${tid}.bts`;
  const named = renameNoReplace(handed, own) ? own : null;
  send({ type: 'thread-start', tid, handed, named });
  Stalker.follow(tid, { transform: cm.transform, data: t });
}

// Without a ring handed ahead (always so with --follow-fork: _top_up in stalker.py) the
// thread asks the host for one and waits for the answer, holding its fork turn throughout
// (onAdded): nothing is then on its way to or from the agent while a fork() is under child
// gating (docs/fork.md section 17).
function askForRing(tid) {
  let reply = null;
  send({ type: 'thread-start', tid });
  recv(`ring:${tid}`, (m) => { reply = m; }).wait();
  Stalker.garbageCollect(); // see takeSpare
  if (reply.path) {
    follow(tid, reply.path);
  }
}

function sendModule(event, m) {
  send({ type: 'module', event, base: m.base.toString(), size: m.size, path: m.path, name: m.name });
}

let observingModules = false; // the observer reports the modules already loaded first
Process.attachModuleObserver({
  onAdded(m) {
    if (observingModules) {
      publishCodeMap();
    }
    sendModule('load', m);
  },
  onRemoved(m) {
    publishCodeMap();
    sendModule('unload', m);
  },
});
observingModules = true;
publishCodeMap();

Process.attachThreadObserver({
  onAdded(thread) {
    if (thread.id !== Process.getCurrentThreadId()) {
      return; // a thread already there as the observer came
    }
    const routine = thread.entrypoint ? thread.entrypoint.routine : null;
    const turn = threadTurn(routine ?? NULL); // also ends its count (bt_on_pthread_create)
    try {
      if (!tracing || !inTracedProcess()) {
        return;
      }
      if (turn === 2) {
        note({
          type: 'thread-untraced', tid: thread.id, routine: routine.toString(), inFork: true,
        });
        return;
      }
      // Frida's injector starts threads of its own (around fork, with child gating) at code
      // in no module; a program's threads start at a function of the program or a library.
      if (routine !== null && Process.findModuleByAddress(routine) === null) {
        note({ type: 'thread-untraced', tid: thread.id, routine: routine.toString() });
        return;
      }
      followNewThread();
    } finally {
      if (turn === 1) {
        giveForkTurn();
      }
    }
  },
});
// No observer of thread ends but while a thread inside a fork() begun before tracing is
// awaited (findForksBegunBefore): the observer runs this script on each ending thread
// without a fork turn.  Called in __call_tls_dtors, before the thread's last code (see
// followAgain).
let endsObserver = null;
function observeEndsOfForksBegunBefore(observe) {
  if (observe && endsObserver === null && forksBegunBefore.size > 0) {
    endsObserver = Process.attachThreadObserver({
      onRemoved(thread) {
        forksBegunBefore.delete(thread.id);
      },
    });
  } else if (!observe && endsObserver !== null) {
    endsObserver.detach();
    endsObserver = null;
  }
}
// After the thread observer, so that it runs after the registry's own hook (see followAgain).
const tlsDtors = Module.findGlobalExportByName('__call_tls_dtors');
new NativeFunction(cm.bt_init_thread_starts, 'void', ['pointer'])(tlsDtors ?? NULL);
if (tlsDtors !== null) {
  attach(tlsDtors, { onEnter: cm.bt_on_tls_dtors });
}

// Signal handlers run untraced; their entries are marked (see stalker_agent.c).
for (const name of ['signal', 'sysv_signal', 'bsd_signal']) {
  const f = Module.findGlobalExportByName(name);
  if (f !== null) {
    attach(f, {
      onEnter: name === 'sysv_signal' ? cm.bt_on_sysv_signal : cm.bt_on_signal,
      onLeave: cm.bt_after_signal,
    });
  }
}
attach(libc('sigaction'), { onEnter: cm.bt_on_sigaction, onLeave: cm.bt_after_sigaction });
sigStub.add(4096).writePointer(cm.bt_signal_enter);
new NativeFunction(cm.bt_note_set_handlers, 'void', [])();

// fork(): handled in C, because no JavaScript can run in a forked child (unless Frida gates
// it, with --follow-fork: then this script lives on in the child too, doing nothing there).
attach(libc('fork'), { onEnter: cm.bt_on_fork_enter, onLeave: cm.bt_on_fork_leave });
let forkDone = attach(libc('fork'), { onLeave: cm.bt_on_fork_done });
routeForksThroughStub();
// Thread starts and fork()s take turns (bt_thread_turn, bt_on_pthread_create in
// stalker_agent.c): with --follow-fork once Frida's fork() hook is in (forkDoneLast), else
// from here.  Without child gating too, a child forked as a thread started inherits Frida's
// state half changed: `fork starts 20` (a thread started right before each fork()) lost a
// child in 2 of 20 recordings without the turns, none in 20 with them.  The hook on
// pthread_create() only with the turns on: each hook costs every thread a stop by Gum at
// the end (letGoOfAll).
function takeTurns(how) {
  attach(libc('pthread_create'),
    { onEnter: cm.bt_on_pthread_create, onLeave: cm.bt_on_pthread_create_leave });
  forkTurns(how);
}
if (!PARAMS.followFork) {
  takeTurns(1);
}

// Frida's heap locks, which a fork() through the stub takes last, in _Fork() (glibc 2.34 and
// later), and lets go of on both sides (bt_on_fork_syscall in stalker_agent.c), found among
// the agent's static data: the unnamed read-write mappings right after its file's.
function agentData() {
  const data = [];
  let agentEnd = null;
  for (const line of procMaps()) {
    const fields = line.trim().split(/\s+/);
    if (fields.length < 5) {
      continue;
    }
    const [start, end] = fields[0].split('-').map((x) => ptr('0x' + x));
    if (line.includes('frida-agent')) {
      agentEnd = end;
    } else if (agentEnd !== null && start.equals(agentEnd) && fields[1].startsWith('rw')
               && fields.length === 5) {
      data.push([start, end]);
      agentEnd = end;
    } else {
      agentEnd = null;
    }
  }
  return data;
}
const forkSyscall = Module.findGlobalExportByName('_Fork');
const findHeapLocks = new NativeFunction(cm.bt_find_heap_locks, 'int', ['pointer', 'uint64']);
const heapLocksFound = forkSyscall !== null
  && agentData().some(([start, end]) => findHeapLocks(start, uint64(end.sub(start).toString())) === 2);
if (heapLocksFound) {
  attach(forkSyscall, { onEnter: cm.bt_on_fork_syscall, onLeave: cm.bt_on_fork_syscall_leave });
}
// GLib's signal lock, which a fork() takes as well (bt_on_fork_syscall), found by the code
// around gsignal.c's own string (bt_find_signal_lock: 26 to 72 ms) in the recording's first
// process; the others have the same agent, so the recorder hands them what it found.
function findSignalLock() {
  const marker = Array.from('-gtk-private-changed\0', (c) => c.charCodeAt(0).toString(16)
    .padStart(2, '0')).join(' ');
  const find = new NativeFunction(cm.bt_find_signal_lock, 'pointer',
    ['pointer', 'uint64', 'pointer', 'pointer', 'uint64']);
  const code = agentRanges('r-x');
  const data = agentData();
  for (const [start, end] of agentRanges('r--')) {
    const at = ptr('0x' + start.toString(16));
    for (const hit of Memory.scanSync(at, end.sub(start).toNumber(), marker)) {
      for (const [codeStart, codeEnd] of code) {
        for (const [dataStart, dataEnd] of data) {
          const lock = find(ptr('0x' + codeStart.toString(16)), codeEnd.sub(codeStart),
            hit.address, dataStart, uint64(dataEnd.sub(dataStart).toString()));
          if (!lock.isNull()) {
            return lock;
          }
        }
      }
    }
  }
  return null;
}
// The offset from the agent's start: null before any process looked, -1 if none found it.
let signalLockOffset = null;
if (heapLocksFound) { // so /proc/self/maps showed the agent
  const agentBase = ptr('0x' + agentRanges()[0][0].toString(16));
  const given = PARAMS.signalLockOffset;
  const lock = given === null ? findSignalLock() : given >= 0 ? agentBase.add(given) : null;
  signalLockOffset = lock === null ? -1 : lock.sub(agentBase).toInt32();
  if (lock !== null) {
    new NativeFunction(cm.bt_use_signal_lock, 'void', ['pointer'])(lock);
  }
}
note({ type: 'fork-heap-locks', found: heapLocksFound, signalLock: signalLockOffset >= 0 });

// Frida's injector puts the agent's thread back after every fork() under child gating (in
// the parent, and in each child it hands us) by hijacking the process's main thread: it
// stops it wherever it is, runs socketpair() and then its loader on it, whose frida_load()
// calls pthread_create(), and puts back the general registers only.  pthread_create() (glibc's
// string routines) changes the vector registers, so the main thread went on with what that
// code left in them, and the program computed with changed registers (tests/programs/
// vecfork.c: xmm and ymm changed at 49 forks of 50; docs/fork.md section 29).  So the loader's
// pthread_create() goes through a stub that saves the vector and x87 state (XSAVE, else
// FXSAVE) before and puts it back after: nothing before it on that path touches them
// (socketpair() is a system call; frida_load() moves pointers).  The loader is found by
// frida_load()'s code at the start of an anonymous mapping, its table of the C library's
// functions by the context that points to it; the stub is mapped for good, as the others,
// and a child inherits the patched table with it.
const LOADER_ENTRY = [ // frida_load() in Frida 17's loader: its offsets are read from it
  0xf3, 0x0f, 0x1e, 0xfa, // endbr64
  0x48, 0x89, 0xf9, // mov rcx, rdi: ctx
  0x48, 0x8d, 0x15, -1, -1, -1, -1, // lea rdx, [rip + frida_main]
  0x48, 0x8d, 0x7f, -1, // lea rdi, [rdi + worker]
  0x31, 0xf6, // xor esi, esi
  0x48, 0x8b, 0x41, -1, // mov rax, [rcx + libc]
  0x48, 0x8b, 0x40, -1, // mov rax, [rax + pthread_create]
  0xff, 0xe0, // jmp rax
];
// the stub's first bytes, by which a forked child knows its parent's (bt_find_loader_slot)
const GUARD_START = [0x53, 0x57, 0x56, 0x52, 0x51, 0x4c, 0x8d, 0x1d];
const findSlot = new NativeFunction(cm.bt_find_loader_slot, 'pointer',
  ['pointer', 'uint64', 'uint64', 'uint64', 'pointer', 'uint64']);
const GUARD_HEAD = GUARD_START.reduceRight((word, b) => word.shl(8).or(b), uint64(0));
function findLoaderSlot() {
  const created = libc('pthread_create');
  for (const line of File.readAllText('/proc/self/maps').split('\n')) {
    const fields = line.trim().split(/\s+/);
    if (fields.length !== 5 || !fields[1].includes('x')) {
      continue; // the loader's mapping is anonymous and executable
    }
    const [start, end] = fields[0].split('-').map((x) => ptr('0x' + x));
    const size = end.sub(start).toInt32();
    let code;
    try {
      code = new Uint8Array(start.readByteArray(LOADER_ENTRY.length));
    } catch (e) {
      continue;
    }
    if (!LOADER_ENTRY.every((b, i) => b < 0 || code[i] === b)) {
      continue;
    }
    const slot = findSlot(start, size, code[23], code[27], created, GUARD_HEAD);
    if (!slot.isNull()) {
      return { slot, start, size };
    }
  }
  return null;
}
// Under child gating Frida's injector also unmaps a dead child's loader: by its pid, some
// 50 ms after the child's agent thread is gone.  Should a thread of a process forked from
// the same parent (which has the loader at the same address) have that pid by then, the
// loader goes from under it: the parent's agent thread, running the loader's code, died of
// SIGSEGV (pidreuse.c, which hands pids out again: 8 and 11 recordings of 150, sealed 0 and
// 1; docs/fork.md section 31).  So under --follow-fork the loader's mapping is sealed
// (mseal(), Linux 6.10): an munmap() of it fails, and it stays after the recording, as the
// stub does.  (NativeFunction gives a 'long' as an Int64.)
const msealSyscall = new NativeFunction(libc('syscall'), 'long',
  ['long', '...', 'pointer', 'uint64', 'uint64']);
let loaderSealed = null;
const injectorGuarded = (() => {
  let loader;
  try {
    loader = findLoaderSlot();
  } catch (e) {
    return false;
  }
  if (loader === null) {
    return false;
  }
  if (PARAMS.followFork) {
    loaderSealed = msealSyscall(462 /* mseal */, loader.start, loader.size, 0).toNumber() === 0;
  }
  const slot = loader.slot;
  if (!slot.readPointer().equals(libc('pthread_create'))) {
    return true; // the stub, in a forked child: its parent's
  }
  const page = 4096; // the code, then: the real pthread_create(), its result, the state
  const stub = mmap(NULL, 2 * page, 3 /* RW */, 0x22 /* PRIVATE|ANONYMOUS */, -1, 0);
  if (stub.equals(ptr(-1))) {
    return false;
  }
  const code = [];
  const ripTo = (offset) => { // disp32 of [rip + disp] (the field last in the instruction)
    const disp = page + offset - (code.length + 4);
    code.push(disp & 0xff, (disp >> 8) & 0xff, (disp >> 16) & 0xff, (disp >> 24) & 0xff);
  };
  const state = (rmByte) => {
    code.push(0x4c, 0x8d, 0x1d); ripTo(64); // lea r11, [rip + state]: 64-aligned
    // x87, SSE, AVX, AVX-512 (not AMX's tiles)
    code.push(0xb8, 0xe7, 0, 0, 0, 0x31, 0xd2); // mov eax, 0xe7; xor edx, edx
    code.push(0x49, 0x0f, 0xae, rmByte); // xsave64/xrstor64 or fxsave64/fxrstor64 [r11]
  };
  code.push(0x53); // push rbx: the stack 16-aligned for the call
  code.push(0x57, 0x56, 0x52, 0x51); // push rdi, rsi, rdx, rcx: the arguments
  state(xsave ? 0x23 : 0x03);
  code.push(0x59, 0x5a, 0x5e, 0x5f); // pop rcx, rdx, rsi, rdi
  code.push(0xff, 0x15); ripTo(0); // call [rip + pthread_create]
  code.push(0x48, 0x89, 0x05); ripTo(8); // mov [rip + result], rax
  state(xsave ? 0x2b : 0x0b);
  code.push(0x48, 0x8b, 0x05); ripTo(8); // mov rax, [rip + result]
  code.push(0x5b, 0xc3); // pop rbx; ret
  stub.writeByteArray(code);
  stub.add(page).writePointer(slot.readPointer());
  if (!Memory.protect(stub, page, 'r-x')) {
    return false;
  }
  Cloak.addRange({ base: stub, size: 2 * page });
  slot.writePointer(stub);
  return true;
})();
note({ type: 'injector-guard', found: injectorGuarded, sealed: loaderSealed });

// A spawned program is traced from the first of these its main thread runs: the
// executable's _init, where Frida holds it (libc calls _init right before the executable's
// constructors and main), or main, should _init be missing or have run already.
if (PARAMS.spawn) {
  const starts = [];
  if (PARAMS.initOffset !== null) {
    starts.push(['_init', Process.mainModule.base.add(PARAMS.initOffset)]);
  }
  const main = findMain();
  if (main !== null) {
    starts.push(['main', main]);
  }
  if (starts.length === 0) {
    send({ type: 'error', message: 'cannot find main in the executable' });
  }
  let started = false;
  for (const [name, at] of starts) {
    attach(at, () => {
      if (!started) {
        started = true;
        park();
        tracing = true;
        follow(Process.getCurrentThreadId(), PARAMS.mainRing, at);
        note({ type: 'traced-from', at: name });
      }
    });
  }
}

// Threads inside a fork() that began before the fork hook was in place: no hook marks them,
// so on attach a thread is looked for in fork()'s code, at its pc or up its stack; the
// return address of fork()'s own frame is where it comes out.  A forked child held by Frida
// is never looked at so: reading its threads' contexts (ptrace, from a helper) can hang for
// good on a thread of Frida's recovery from fork().
let forkCode = null;
function forkReturnAddress(context) {
  if (forkCode === null) {
    const start = libc('fork');
    const module = Process.findModuleByAddress(start);
    const symbol = module === null ? undefined
      : module.enumerateSymbols().find((s) => s.address.equals(start) && s.size > 0);
    forkCode = { start, end: start.add(symbol === undefined ? 0 : symbol.size) };
  }
  const inCode = (a) => a.compare(forkCode.start) >= 0 && a.compare(forkCode.end) < 0;
  const frames = [context.pc, ...Thread.backtrace(context, Backtracer.ACCURATE)];
  let last = -1;
  frames.forEach((a, i) => { if (inCode(a)) last = i; });
  if (last < 0) {
    return null;
  }
  const back = last + 1 < frames.length ? frames[last + 1] : ptr(0);
  // called from Frida's code: through the fork() hook (Interceptor's trampoline), so not
  // begun before it.  A probe there would patch the trampoline, and the program die in it.
  return Cloak.hasRangeContaining(back) ? null : back;
}
const probedReturns = new Set();

// tid -> where its fork() returns, for each of the program's threads `tids` inside a fork()
// not through the hook
function threadsInsideFork(tids) {
  const inside = new Map();
  for (const tid of tids) {
    const thread = inFork.has(tid) ? null : Process.findThreadById(tid);
    const context = thread === null ? null : thread.context;
    // reading the context lets other threads run JavaScript meanwhile: the thread may have
    // entered fork() through the hook since
    const back = context === null || inFork.has(tid) ? null : forkReturnAddress(context);
    if (back !== null) {
      inside.set(tid, back);
    }
  }
  return inside;
}

// Until when the host waits for them to come out; then the others are followed, and they
// where they come out (one can be held in fork() for good, by an atfork handler).
let waitForForksBegunBefore = 0;

function findForksBegunBefore(tids) {
  waitForForksBegunBefore = Date.now() + 2000;
  for (const [tid, back] of threadsInsideFork(tids)) {
    try {
      if (back.isNull()) {
        throw new Error("no caller of fork() found on the thread's stack");
      }
      const key = back.toString();
      if (!probedReturns.has(key)) {
        attach(back, cm.bt_on_fork_return);
        probedReturns.add(key);
      }
      forksBegunBefore.set(tid, null);
      holdReturns(1);
    } catch (e) {
      forksBegunBefore.set(tid, `inside fork(), and its way out cannot be hooked: ${e.message}`);
    }
  }
  // One that came out before the probe on its way out was in place is out: waiting for it,
  // or following it where it next returned from fork(), would miss all it did meanwhile.
  const still = threadsInsideFork([...forksBegunBefore.keys()]);
  for (const tid of [...forksBegunBefore.keys()]) {
    if (!still.has(tid)) {
      forksBegunBefore.delete(tid);
    }
  }
  observeEndsOfForksBegunBefore(true);
}

// The program's calls of fork() go through bt_fork_gate (stalker_agent.c) while forks are
// held: each GOT slot of fork() points there meanwhile.
const gated = []; // [slot, what it held]
let gateOn = false; // the host asks again every millisecond while it waits
function gateForks() {
  if (gateOn) {
    return;
  }
  gateOn = true;
  for (const slot of forkCallSlots()) {
    const held = writeSlot(slot, cm.bt_fork_gate);
    if (held !== null) {
      gated.push([slot, held]);
    }
  }
}
function ungateForks() {
  gateOn = false;
  for (const [slot, original] of gated.splice(0)) {
    writeSlot(slot, original);
  }
}

// The host lets held forks go with a message, not an rpc call: the call's reply would still
// be on its way out as they went ahead, and the child of one, under child gating, inherits
// that unfinished exchange with the host and dies in Frida's recovery from fork()
// (agent+0x2dcd2a).  A message of the host's leaves nothing unfinished here.
function releaseForks() {
  holdForks(0);
  ungateForks();
  holdReturns(0);
  recv('release-forks', releaseForks);
}
recv('release-forks', releaseForks);

// The pages a forked child that is not followed maps again from their files: noted once
// every hook of the set-up is in, Frida's own too, and again at each hook added later (a
// signal handler's, a probe where a fork() returns).
const noteHooks = new NativeFunction(cm.bt_note_hooked_pages, 'int', []);
if (!PARAMS.followFork) {
  hooksNoted = true;
  noteHooks();
}

rpc.exports = {
  // The program's threads among `tids` (the process's, from /proc): Frida's own and the
  // parked one are not.  Process.enumerateThreads() is not used to find them: it reads every
  // thread's registers, Frida's own too, through a helper that ptraces each in turn, and that
  // helper was seen waiting 15 s for a thread of Frida's that did not stop.
  threads(tids) {
    const parked = state.add(PARKED).readS32();
    return tids.filter((tid) => tid !== parked && !Cloak.hasThread(tid));
  },
  // Attaching, before the first hold: finds the threads inside a fork() that began before
  // the fork hook, which the host then waits for as for the others (see forkReturnAddress).
  findForksBegunBefore(tids) {
    gateForks();
    withSignalsBlocked(() => findForksBegunBefore(tids)); // it reads the threads' registers
  },
  // Where BtState's fork() counters are, which the host reads and writes itself at the end
  // of a recording under --follow-fork (_ForkCounters in stalker.py).
  forkCounters() {
    return {
      held: state.add(PARKED - 8).toString(), // BtState.forks_held
      inFlight: state.add(PARKED - 4).toString(), // BtState.forks_in_flight
      passing: state.add(PARKED + 12).toString(), // BtState.forks_passing
      gated: state.add(PARKED + 8).toString(), // BtState.forks_gated
    };
  },
  // Once Frida's fork() hook is in (child gating): a fork() counts as under way until
  // Frida's recovery from it is done too (bt_on_fork_done).  Only while no fork() is under
  // way and new ones are held at fork()'s entry: for a moment both listeners are attached.
  forkDoneLast() {
    const last = attach(libc('fork'), { onLeave: cm.bt_on_fork_done });
    forkDone.detach();
    forkDone = last;
    // A forked child's script: its fork() listeners come after Frida's hook, so its turns
    // are taken ahead of it, in its copy of the parent's fork stub (bt_fork_first)
    takeTurns(PARAMS.forkStub ? 1 : 2 /* BT_TURNS_AHEAD_ONLY */);
    if (parentsForkSlots !== null) {
      markSlot.writePointer(cm.bt_fork_first);
    }
  },
  // hold new fork()s (bt_hold_forks); how many are still under way
  holdForks(how) {
    gateForks();
    let begunBefore = 0;
    if (Date.now() < waitForForksBegunBefore) {
      for (const why of forksBegunBefore.values()) {
        begunBefore += why === null ? 1 : 0;
      }
    }
    return holdForks(how) + begunBefore;
  },
  // Follows the threads of `paths` (tid -> ring).  Attaching (`running`), one still inside a
  // fork() that began before the hook (the host waits for those only so long) is followed
  // where that fork() returns (Stalker would take it through fork() and its child would die);
  // returns {tid: why} for those that cannot be so followed.
  followAll(paths, running) {
    park();
    tracing = true;
    const untraced = {};
    withSignalsBlocked(() => {
      for (const [tid, path] of Object.entries(paths)) {
        const id = parseInt(tid, 10);
        const why = running ? forksBegunBefore.get(id) : undefined;
        if (outOfFork.delete(id)) {
          returning.set(id, path); // followed where it waits
        } else if (why === undefined) {
          follow(id, path);
        } else if (why === null) {
          returning.set(id, path);
        } else {
          untraced[tid] = why;
        }
      }
    });
    holdReturns(0);
    observeEndsOfForksBegunBefore(false);
    return untraced;
  },
  // Ends the recording: {farBlocks, stillInFork: tids never out of their fork(), asleep:
  // tids that have not run since (leftStalker)}.
  stop() {
    return finish();
  },
  // Where thread `tid`, asleep since stop(), entered the last system call it made under
  // Stalker: the address of the program's instruction (a string), or null.  The host asks
  // with the thread stopped, and moves it out of Stalker there (asleep.py).
  asleepAt(tid) {
    const t = asleepThreads.get(tid);
    return t === undefined ? null : threadAsleepAt(t).toString();
  },
  // The agent's signal stack armed in that thread (a string), or null (bt_thread_altstack).
  signalStack(tid) {
    const t = asleepThreads.get(tid);
    const stack = t === undefined ? uint64(0) : threadAltstack(t);
    return stack.equals(0) ? null : stack.toString();
  },
  // Whether thread `tid`, asleep since stop(), has still neither left Stalker by itself nor
  // been let go of by the host (bt_thread_let_go).
  stillAsleep(tid) {
    const t = asleepThreads.get(tid);
    return t !== undefined && threadLetGo(t) === 0;
  },
  // The host has let go of thread `tid`, stopped asleep: `how` is 'moved' (out of Stalker's
  // code) or 'native' (it was in the program's own code); `disarmed`: it disarmed the
  // agent's signal stack there.  Whether Stalker's context for the thread was let go of too
  // (bt_thread_let_go_asleep).
  letGoAsleep(tid, how, disarmed) {
    const t = asleepThreads.get(tid);
    return t !== undefined &&
      threadLetGoAsleep(t, how === 'moved' ? 1 : 0, disarmed ? 1 : 0) === 1;
  },
  // Ends the trace and lets go of the threads, before child gating goes off; stop() does
  // the rest.
  unfollow() {
    unfollowAll();
  },
  // Frida unloads the script without stop() when the host is gone or drops the session: the
  // rings are closed all the same, and the parked thread must return for the unload to end.
  // Not in a forked child, where Frida closes its copy of this script (park).  Frida
  // also calls it as the program enters exit(), _exit() or abort(), to stop everything
  // there; but what exit() runs (atexit handlers, destructors, the stdio flush) is the
  // program's code, and a crash there is one to debug: the threads stay followed, each
  // ring closed at its thread's exit system call or left open by a kill, read as after a
  // crash (on_exit_syscall in stalker_agent.c).
  // Under child gating (--follow-fork) Frida calls it with 'exec' before any execve() it
  // sees, without unloading the script: also one that fails, after which the program runs
  // on, and one made by a posix_spawn(), system() or popen() child, which shares this
  // memory until its exec, and whose parent runs on (stopping here ended the program's
  // trace there).  The program's own exec ends its image and so its trace, the rings read
  // as after any exec.  Frida calls this once only: after such an exec, a host that goes
  // away leaves the unload to Frida, which lets go of the threads (the program runs on,
  // its rings in the trace directory).
  dispose(reason) {
    if (reason !== 'exit' && reason !== 'exec') {
      forkTurns(0); // Frida's fork() hook is gone (bt_fork_turns)
      if (inTracedProcess()) {
        finish();
      }
    }
  },
};

// Stalker lets go of another thread only where the thread next passes through Stalker's
// own code, and code Stalker has compiled jumps straight from block to block: a thread in a
// loop ran on in it after unfollow().  So each thread leaves by itself, at the next block
// it runs (bt_thread_let_go, context_to_let_go in stalker_agent.c).  Only blocks with a record
// can; a thread in the others (Frida's code, or blocks compiled once the block table was
// full) runs on in them, through its compiled copies of the hooks' code too.  Once a hook
// is gone (Frida's on close() as child gating goes off: its fd guard; ours as this script
// unloads) such a copy calls into what Frida freed, and the program dies (attached with
// --follow-fork to a program closing a file every millisecond: 10 of 10).  So every hooked
// function's block is invalidated as well: a thread that reaches one goes through
// Stalker, which lets go of it there, and the function runs natively.
function unfollowAll() {
  withSignalsBlocked(letGoOfAll); // Stalker's unfollow and invalidate start helpers
}
function letGoOfAll() {
  tracing = false;
  new NativeFunction(cm.bt_restore_handlers, 'void', [])();
  // fork()s wait at their entry meanwhile, and those past it are waited for (1 s at most):
  // a thread unfollowing itself in beforeFork frees the Stalker context that Gum's unfollow
  // and invalidate of the thread below are using (bt_hold_forks_at_entry)
  const forksHeldHere = holdForksAtEntry(1) >= 0;
  const forksWaitedFor = Date.now() + 1000;
  while (forksHeldHere && forksInFlight() > 0 && Date.now() < forksWaitedFor) {
    Thread.sleep(0.001);
  }
  // the same for threads taking a fresh Stalker context (renew_context)
  while (holdRenewals() > 0 && Date.now() < forksWaitedFor) {
    Thread.sleep(0.001);
  }
  try {
    letGoOfThreads();
  } finally {
    if (forksHeldHere) {
      holdForksAtEntry(0);
    }
  }
}
function letGoOfThreads() {
  unkeepForks();
  const hooks = [...hookedAt, cm.bt_fork_gate, ...(stubInUse === null ? [] : [stubInUse]),
    ...fridaHooks()];
  for (const tid of threads.keys()) {
    Stalker.unfollow(tid);
  }
  // The trace ends here.  Each invalidation lets other threads run this script's callbacks,
  // and a fork() met meanwhile wrote its GAP into a ring left open (slowfork: 11 GAPs, 9
  // calls of f between them, when every block was invalidated).  Not every block: Gum
  // stops the thread with ptrace for each block it finds, and retries for as long as the
  // thread is in that block -- for good, for a thread asleep in a system call there (a
  // shell in wait4(): the agent did not answer).
  const deadline = closeDeadline();
  for (const t of threads.values()) {
    threadClose(t, deadline);
    threadLetGo(t);
  }
  for (const tid of threads.keys()) {
    for (const at of hooks) {
      Stalker.invalidate(tid, at);
    }
  }
  Stalker.flush();
  Stalker.garbageCollect();
}

// The threads that have not left Stalker (bt_thread_let_go) 0.1 s after the end: asleep in
// a system call since, as a rule (a server waiting for input), which the host then lets go
// of itself (asleep.py, with asleepAt and letGoAsleep); one it cannot leaves as it wakes,
// and Frida unloads its agent only then.  `wp` is set again meanwhile, for a thread that
// moved it on as it was set.
function leftStalker() {
  const deadline = Date.now() + 100;
  let waiting = [...threads.entries()];
  for (;;) {
    waiting = waiting.filter(([, t]) => threadLetGo(t) === 0);
    if (waiting.length === 0 || Date.now() >= deadline) {
      return waiting;
    }
    Thread.sleep(0.005);
  }
}
const asleepThreads = new Map(); // tid -> BtThread of the threads leftStalker found asleep

// Frida's own hooks in libc (child gating's on fork(), exec*() and close(), its exit
// monitor's): functions whose first instruction jumps into Frida's memory.
function fridaHooks() {
  const found = [];
  for (const e of Process.getModuleByAddress(libc('close')).enumerateExports()) {
    if (e.type !== 'function') {
      continue;
    }
    let insn = null;
    try {
      insn = Instruction.parse(e.address);
    } catch (_) {
      continue; // not code
    }
    if (insn.mnemonic === 'jmp' && insn.operands[0].type === 'imm' &&
        Cloak.hasRangeContaining(ptr(insn.operands[0].value.toString()))) {
      found.push(e.address);
    }
  }
  return found;
}

// The page the recorder held the main thread in while Frida attached (mainhold.py): gone
// with the agent, once the thread has left it (the stub's `done` word, at 0x208).
function unmapHoldPage() {
  if (PARAMS.holdPage === null) {
    return;
  }
  const [base, size] = PARAMS.holdPage;
  if (!ptr(base).add(0x208).readU64().equals(0)) {
    new NativeFunction(libc('munmap'), 'int', ['pointer', 'size_t'])(ptr(base), size);
  }
}

let finished = null;
const noteOffTrace = new NativeFunction(cm.bt_note_off_trace, 'void', []);
function finish() {
  if (finished !== null) {
    return finished;
  }
  noteOffTrace();
  unfollowAll();
  restoreGumReader();
  const asleep = [];
  for (const [tid, t] of leftStalker()) {
    asleepThreads.set(tid, t);
    asleep.push(tid);
  }
  const stillInFork = [...returning.keys()];
  returning.clear();
  let far = farOfEarlier;
  for (const t of threads.values()) {
    far += threadFarBlocks(t).toNumber();
  }
  threads.clear();
  releaseFaults();
  release();
  holdForks(0); // else a fork() held as the host went away would wait for good
  ungateForks();
  holdReturns(0);
  unmapHoldPage();
  finished = { farBlocks: far, stillInFork, asleep };
  return finished;
}

send({ type: 'ready', signalLockOffset, gumReaderMatch, gumReaderScanned });
