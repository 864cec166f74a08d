/*
 * The stalker engine's hot path, compiled inside the traced process by Frida's CModule.
 *
 * Python splices this file after a prelude (libc declarations, the bt_futex_* hooks), the
 * generated BT_* definitions and bt_writer.h, so the layout has a single definition.
 *
 * Each executed block of code costs a 4-byte slot: the block's id, a number the agent gives
 * the block when Stalker compiles it, with the block's BLOCK word in the ring's block table
 * at that index (docs/format.md, "Block ids").  The slot is written by a few inline
 * instructions that Stalker compiles into the block itself.  Most blocks overwrite a
 * register before reading it (a mov, a pop, a load of a local), which the lookahead in
 * dead_state() proves; such a block writes its slot through that register and saves
 * nothing.  `wp`, the thread's write pointer, is the ring header's inline_ptr, in a second
 * mapping of the header page below 2 GiB, so it is a 32-bit absolute address and a reader
 * finds where the records end after the process died (chunks are not zeroed):
 *
 *   mov    rdi, [wp]              ; the thread's write pointer, 4 bytes past the last slot
 *   mov    qword [rdi-4], ID      ; the id, and a zero for the next slot
 *   lea    rdi, [rdi+4]
 *   mov    [wp], rdi
 *   test   di, di                 ; low 16 bits: zero exactly at a 64 KiB chunk boundary
 *   jz     tail                   ; the chunk's callout, after the block's last instruction
 *
 * The test is allowed only when the block also sets every status flag before testing one.
 * When the flags are live the register must be rcx and the check is `movzx ecx, cx; jrcxz`,
 * whose short reach keeps the callout inline, behind a jmp.  A block with no dead register
 * saves rax (and rcx, unless the flags are dead) in the thread's own memory, not on its
 * stack, and writes the same slot through rax:
 *
 *   movabs [saved_rax], rax
 *   mov    rax, rcx               ; only with the flags live: rcx for the jrcxz
 *   movabs [saved_rcx], rax
 *   movabs rax, [wp]
 *   mov    qword [rax-4], ID
 *   lea    rax, [rax+4]
 *   movabs [wp], rax
 *   test   ax, ax ; jz tail       or (flags live)   movzx ecx, ax ; jrcxz slow
 *   ...    movabs rax, [saved_rcx] ; mov rcx, rax ; movabs rax, [saved_rax]
 *
 * No compiled block runs on the thread between the save and the restore (signal handlers
 * run natively, outside Stalker's code cache, and the slow path is a callout), so the
 * slots need no nesting.  Measured inside the program (call loop, 40M calls, best of 5):
 * saving below the red zone with lea/push/pop instead took 0.135 s against 0.120 s, and
 * reading `wp` through a 32-bit absolute address in such a block instead of movabs made the
 * loop twice as slow (0.26 s), for reasons the CPU does not say; the short sequences above
 * showed no such cost (movabs and a save in every block was slower: 0.128 s).
 *
 * A block may start with a jcc that reads flags set by the block before, so the flags are
 * only ever touched when proven dead.  The ring's data area is mapped 64 KiB aligned, so
 * the chunk check is the movzx.  Once per 64 KiB chunk (~16,000 slots) the slow path (a
 * Stalker callout, which saves the whole CPU context) claims the next chunk through
 * bt_writer.h: waiting for the host in stream mode, moving data_tail in wrap mode, or
 * diverting the writes to a scratch chunk, counted as lost, in drop mode.
 *
 * data_head is published once per chunk.  The records after it are still found by a
 * reader once this process is gone (the OFD writer lock dies with it): see docs/format.md,
 * "a late reader".
 */

#define BT_CHUNK 65536
/* A thread's refollow stub (bt_new_refollow in stalker_agent.js): the thread's vector
   state saved and its stack pointer below the red zone, 16 bytes of nop from
   BT_REFOLLOW_HOOK on that Frida's hook takes, both put back, then a jump through the
   target at BT_REFOLLOW_TARGET (the next page). */
#define BT_REFOLLOW_HOOK 80
#define BT_REFOLLOW_TARGET 4096
/* C code reads and moves `wp` through the ring's own mapping of the header (wpc), never
   through the one below 2 GiB that the inline code uses (wpp), which a held signal makes
   inaccessible for a moment (hold_signal) */
#define WP(t) (*(t)->wpc)
/* wp points this far past the last slot: a slot is stored as 8 bytes at wp - 4, the block
   id and a zero for the slot after it, so a word is always whole (docs/format.md) */
#define SLOT_LEAD 4
/* nested signal handlers whose frame a thread notes (bt_on_handler_entry) */
#define BT_HANDLER_DEPTH 8
#define UC_RIP 168 /* a ucontext's uc_mcontext.gregs[REG_RIP] */
#define UC_SIGMASK 296  /* uc_sigmask: the mask the signal interrupted */

typedef struct {
  uint64_t *wpp;         /* the write pointer: the ring header's inline_ptr, or `wp` */
  uint64_t *wpc;         /* the same word, as C code reaches it (WP) */
  uint64_t wp;
  uint8_t *header32;     /* the ring's header page mapped again below 2 GiB, or NULL */
  struct bt_writer w;
  uint8_t *scratch;      /* 64 KiB-aligned chunk that takes writes while dropping */
  int dropping;
  int closed;
  uint32_t tid;
  uint64_t map_size;
  uint8_t *reserve;
  uint64_t reserve_size;
  uint64_t far_blocks;   /* blocks compiled above 2^47, which a BLOCK word cannot hold */
  cs_insn *cs_insn;      /* the lookahead's instruction (NULL: none made yet) */
  uint64_t *table;       /* the ring's block table: block id -> BLOCK word */
  uint64_t table_cap;
  uint64_t next_id;      /* 0 is the empty slot */
  uint64_t *spill;       /* (thread, BLOCK word) pairs of the blocks compiled once the
                            table was full, which a callout records */
  uint64_t spill_left;
  uint64_t run_start;    /* where the slots written since C code last wrote begin */
  uint64_t saved_rax;    /* the program's registers while a block that has no dead */
  uint64_t saved_rcx;    /* register writes its slot */
  /* handler entries whose GAP waited for C code to finish: `due` is only written by the
     handler entry hook, `done` only by the code it interrupts, so neither update can be
     lost to the other (a handler runs between two instructions of a `--`) */
  volatile uint64_t signal_gaps_due;
  uint64_t signal_gaps_done;
  volatile int in_c;     /* the thread is inside C code that moves the head or `wp` */
  volatile int writer_lock;     /* held by whoever moves them (enter_c, bt_thread_close) */
  volatile int close_requested; /* the script found the thread in its C code at the end */
  uint8_t *scratch_area; /* the mapping `scratch` lies in */
  uint8_t *exec_ctx;     /* Stalker's GumExecCtx for the thread, as its last block compiled */
  volatile int leaving;  /* the recording has ended: leave Stalker at the next chunk callout */
  volatile int left;     /* that callout came (bt_thread_let_go), or the host moved it out */
  uint64_t syscall_at;   /* the program's system call instruction the thread last entered */
  struct BtCopyChunk *copies; /* where its blocks' instructions are in Stalker's copy */
  int handlers_running;  /* signal handlers entered and not returned from (bt_on_longjmp) */
  uint64_t handler_uc[BT_HANDLER_DEPTH]; /* each one's signal frame and the pc it held as */
  uint64_t handler_pc[BT_HANDLER_DEPTH]; /* the handler was entered (bt_on_sigreturn) */
  uint8_t *refollow;     /* where a thread whose handler moved its pc is followed again */
  int altstack_tried;    /* arm_altstack() has run on the thread */
  uint8_t *altstack;     /* the signal stack it armed for the thread, or NULL */
  uint64_t fault_ip;     /* the program's instruction of the fault deliver() handed the */
  uint64_t fault_resume; /* program's handler, and where in Stalker's copy it goes on */
  uint64_t populated;    /* the head up to which the ring's pages are mapped in ahead */
  uint64_t populate_end; /* (populate_ahead), and where its first lap ends */
  int fork_kept;         /* in a fork() called through the fork stub (bt_fork_mark) */
  int ending_turn;       /* holds the fork turn from its call of __call_tls_dtors */
  int fork_entered;      /* on its way into a fork(), entered ahead of the hook (bt_fork_first) */
  int fork_native;       /* came through the fork stub: runs fork() natively, until _Fork()
                            (bt_on_fork_syscall, hooked only once both heap locks are found) */
  uint64_t ctx_blocks;   /* the program's blocks compiled in `exec_ctx` (renew_context) */
  int renewing;          /* on its way to the refollow stub to get a fresh context */
  int renew_stub_asked;  /* a callout asked for the refollow stub, for renew_context */
  int64_t clone_ns;      /* when it last entered clone() or clone3() (put_renewal) */
  /* for each handler entered, where in Stalker's copy the interrupted code goes on (0: the
     handler ran natively), and the last instruction of the block it was in (0: the
     handler came before the block's record), so that its return is traced (bt_signal_enter) */
  uint64_t handler_copy[BT_HANDLER_DEPTH];
  uint64_t handler_last[BT_HANDLER_DEPTH];
  uint8_t *handler_ctx[BT_HANDLER_DEPTH];
  /* the record sequence's slots for rax and rcx, as the handler was entered: a handler
     that interrupted a sequence between its save and its load finds them as they were */
  uint64_t handler_saved[BT_HANDLER_DEPTH][2];
  uint64_t ret_copy;     /* a `ret` of the program's compiled in `ret_copy_ctx` */
  uint8_t *ret_copy_ctx;
  /* a signal that came in Gum's code at a block's end, held until the next block's record
     (hold_signal): its number (0: none), the frame of the fault that lets it go, and its
     siginfo */
  volatile int held_sig;
  int held_with_info;  /* the kernel wrote held_info: the handler is SA_SIGINFO */
  uint64_t trap_uc;
  uint8_t held_info[128];
  uint64_t let_go_pc; /* where the last held signal was let go: never held again there */
  uint64_t held_for_uc; /* a signal held at the signal stub's entry: the frame of the
                           signal under it, whose handler it is to interrupt (hold_signal) */
  uint64_t epilog_seen; /* the epilog helper of Gum's its last callout calls (put_callout) */
} BtThread;

static void settle_held_signal(BtThread *t);

/* The agent's signal stacks (arm_altstack): 8 MiB above a guard page, reserved only (the
   pages a handler touches are all it costs).  A handler the program registers with
   SA_ONSTACK for another signal, in a thread without a signal stack of its own, runs on
   it, where natively it runs on the thread's stack: with 64 KiB, one using 100 KiB of
   stack (fine untraced) killed the program (tests/programs/onstack.c).  8 MiB is what a
   thread's stack usually is. */
#define BT_ALTSTACK_SIZE (8 * 1024 * 1024)
#define BT_GUARD 4096
#define BT_SS_DISABLE 2
#define BT_SS_AUTODISARM (1U << 31)
typedef struct {
  void *sp;
  int flags;
  uint64_t size;
} BtStack; /* the kernel's stack_t */

/* Where each instruction of a block went in Stalker's copy of the code (the thread's code
   cache), so that a fault, whose pc is in the copy, names the program's instruction
   (write_fault), or a signal, where it may be followed into its handler (bt_signal_enter).
   Written as each block compiles, 32 bytes and 4 per instruction, into
   chunks of the thread's own; read only on a fault, newest first: Stalker may compile a
   block again elsewhere, and a thread followed again gets a new cache. */
#define BT_COPY_CHUNK (256 * 1024)
#define BT_COPY_MAX 128 /* instructions mapped per block; a fault past them is not named */
typedef struct {
  uint64_t copy;      /* the block's first byte in Stalker's cache */
  uint64_t start;     /* the program's address of its first instruction */
  uint32_t copy_size;
  uint16_t n;         /* instructions mapped: the first n of the block */
  uint16_t whole;     /* 1: that is all of them */
  /* in the block's record: where it reads `wp`; from where the slot is written up to where
     the chunk check jumps nowhere but on; where the registers it saved are loaded back;
     and where the first instruction's copy starts.  Then where the code Gum wrote for the
     block's last instruction ends (its branch to the next block) */
  uint16_t read_at, written_at, check_end, restore_at, first_at, branch_end, pad[2];
  uint16_t offsets[]; /* n offsets into the copy, then n into the program's block */
} BtCopy;
typedef struct BtCopyChunk {
  struct BtCopyChunk *prev;
  /* the copies its entries span: a lookup (one per signal handler run) reads only the
     chunks whose span holds the pc, not every block the thread compiled */
  uint64_t lo, hi;
  uint64_t used; /* bytes of BtCopy entries after this header */
} BtCopyChunk;

/* The kernel's struct sigaction (rt_sigaction), for the fault handler (catch_faults). */
typedef struct {
  void *handler;
  uint64_t flags;
  void *restorer;
  uint64_t mask;
} BtSigaction;
#define BT_FAULT_SIGNALS 7

#define BT_MAX_THREADS 4096
#define BT_HOOKED_PAGES 64
#define BT_MAX_SPARED 16

/* A file of Frida's, by its fd when the agent was loaded and what it was: the fd's inode,
   or for an event fd (all share one inode) its eventfd-id.  Frida may have closed it since
   and the program got the number, so it is checked before it is spared (still_fridas). */
typedef struct {
  int fd;
  uint32_t is_eventfd;
  uint64_t id;
} BtSpared;

/* Process-wide state in writable memory the host passes in (CModule globals are
   read-only). */
typedef struct {
  uint32_t pid;          /* the traced process; any other pid is a forked child */
  int nthreads;
  BtThread *threads[BT_MAX_THREADS];
  int ic_ticket;         /* widen_inline_cache(): the thread that draws 0 does it */
  volatile int ic_done;
  int forks_held;        /* bt_hold_forks(): fork() waits at its entry meanwhile */
  int forks_in_flight;   /* threads between fork()'s entry and its end (bt_on_fork_done) */
  volatile int parked;   /* the parked thread's tid, once it waits (park() in the script) */
  int fork_turn;         /* the tid of the thread whose fork() Frida handles (take_fork_turn) */
  int forks_gated;       /* bt_fork_gate(): fork() calls wait before fork() meanwhile */
  int forks_passing;     /* threads past that gate and not yet back from fork() */
  int returns_held;      /* bt_on_fork_return(): threads out of a fork() begun before the
                            hook wait there meanwhile, until the host has their rings */
  int slots_lock;        /* taking or giving back a slot of `threads` (take_slot) */
  int nspared;           /* on_close_range(): Frida's files, which it leaves open */
  int spared_pad;
  BtSpared spared[BT_MAX_SPARED];
  /* is_frida_code(): replaced whole, never changed (x86 keeps the script's stores in order) */
  const struct BtCodeMap *volatile code_map;
  uint8_t *stalker; /* the GumStalker, once widen_inline_cache() has checked its layout */
  /* the handlers on_fault() took the place of and calls on (0: not taken), by signal as in
     fault_signals */
  BtSigaction chained[BT_FAULT_SIGNALS];
  uint64_t faults_taken; /* bit i: on_fault() took signal fault_signals[i] */
  /* what the program last asked for those signals with sigaction() or signal() (Frida
     keeps it, and calls the handler from its own), by signal as in fault_signals */
  BtSigaction program[BT_FAULT_SIGNALS];
  uint64_t program_known; /* bit i: program[i] holds it */
  /* the fork stub's slot for bt_fork_mark, and a `ret` of the stub (forkStub in the script) */
  uint64_t *fork_mark_slot;
  uint64_t fork_noop;
  int fork_turns;        /* fork()s take turns (bt_fork_turns) */
  int threads_starting;  /* from the program's pthread_create() to the thread's onAdded */
  int forks_pending;     /* fork()s that new threads wait for (wait_for_thread_starts) */
  int starts_in_fork;    /* threads started by a fork()'s own thread inside it, not yet up */
  uint64_t tls_dtors;    /* __call_tls_dtors, or 0 */
  int *heap_locks[2];    /* Frida's heap's spin locks, or NULL (bt_find_heap_locks) */
  volatile int heap_locked_by; /* the thread holding them across a fork(), or 0 */
  int glib_locks_held;   /* which of GLib's that thread holds as well: FORK_HELD_* */
  int *signal_lock;      /* GLib's signal lock, or NULL (bt_find_signal_lock) */
  int unhook_children;   /* 1: a forked child, not followed, gets its code back */
  int nhooked_pages;     /* the pages that then go back to their files' (bt_note_hooked_pages) */
  uint64_t hooked_pages[BT_HOOKED_PAGES];
  int renewals_held;     /* bt_hold_renewals(): the recording ends, no context is renewed */
  int renewals_in_flight; /* threads inside renew_context() */
} BtState;

extern uint8_t bt_state[];
#define STATE ((BtState *)bt_state)

/* Where code is, for is_frida_code(): the mappings of Frida's agent and the modules of the
   program, sorted by start and disjoint, as the script last saw them (stalker_agent.js,
   publishCodeMap). */
typedef struct {
  uint64_t start, end;
  uint64_t fridas; /* 1: Frida's agent; 0: a module of the program */
} BtCodeRange;
struct BtCodeMap {
  uint64_t count;
  BtCodeRange ranges[];
};

/* Whether a block starts in Frida's code (the hook that started tracing, the return from
   Stalker.follow() of a new thread through Frida's code), which gets no record.  Asked
   once per compiled block.  The script's Cloak answers only for code in no range: a thread
   compiling a block of Frida's agent, or of libc called from it, may hold a lock of the
   agent's (GLib's signal lock), and the script's lock, which the answer needs, may be held
   by a thread waiting for that one (a new thread's Stalker.garbageCollect()). */
static const BtCodeRange *code_range(uint64_t address) {
  const struct BtCodeMap *map = STATE->code_map;
  if (map == NULL)
    return NULL;
  uint64_t lo = 0, hi = map->count;
  while (lo < hi) {
    uint64_t mid = (lo + hi) / 2;
    if (address < map->ranges[mid].start)
      hi = mid;
    else if (address >= map->ranges[mid].end)
      lo = mid + 1;
    else
      return &map->ranges[mid];
  }
  return NULL;
}

int bt_thread_turn(uint64_t routine);
static void give_fork_turn(void);

/* A thread of the program runs this script's JavaScript only with its fork turn, taken
   before it waits for the script's lock: a fork() meanwhile left its child that lock (a
   recursive mutex) held by a thread the child does not have, and Frida's recovery in the
   child waited on it for good (docs/fork.md sections 18 and 21).  Each new thread asked
   the script about some 30 blocks as Stalker compiled them (the hooked functions' first
   instructions, which run relocated in Frida's memory), right after its onAdded had given
   its turn back.  Returns whether the turn is to be given back (leave_script). */
static int enter_script(void) {
  return bt_thread_turn(0) == 1;
}

static void leave_script(int turn) {
  if (turn)
    give_fork_turn();
}

static int is_frida_code(uint64_t address) {
  const BtCodeRange *range = code_range(address);
  if (range != NULL)
    return (int)range->fridas;
  int turn = enter_script();
  int fridas = bt_is_frida_code(address);
  leave_script(turn);
  return fridas;
}

static int in_forked_child(void) {
  return (uint32_t)getpid() != STATE->pid;
}

static uint8_t *align_up(uint8_t *p, uint64_t a) {
  return (uint8_t *)(((uint64_t)p + a - 1) & ~(a - 1));
}

static uint64_t wp_position(BtThread *t) {
  uint64_t chunk_start = t->w.claim_end - BT_CHUNK;
  uint8_t *chunk_ptr = (uint8_t *)t->w.data + (chunk_start & t->w.mask);
  return chunk_start + ((uint8_t *)WP(t) - SLOT_LEAD - chunk_ptr);
}

/* The records written, counted as they are written (the header's counted_* fields) so
   that the host does not have to scan a stream's words to count them.  A process killed
   with its rings open (Ctrl-C) never finishes them: the header's counted_to says up to
   which stream position they are exact, and a reader counts only the words after it.  It
   is 0 from here until the count is exact again (publish_counted): a thread killed in
   between leaves its reader to count the whole stream. */
static void add_counted(BtThread *t, uint64_t n) {
  BT_HDR64(&t->w, BT_OFF_COUNTED_TO) = 0;
  bt_barrier();
  BT_HDR64(&t->w, BT_OFF_COUNTED_RECORDS) = BT_HDR64(&t->w, BT_OFF_COUNTED_RECORDS) + n;
}

/* Every record before the head is counted, and the inline records that follow it (block
   slots), up to the write pointer, are not (refill).  A reader of a dead writer reads
   records up to data_head or the write pointer, whichever is further: the count is
   published only once those reach the head. */
static void publish_counted(BtThread *t) {
  bt_barrier();
  BT_HDR64(&t->w, BT_OFF_COUNTED_TO) = t->w.head;
}

/* The slots written since run_start, up to the byte position `end`. */
static void count_slots(BtThread *t, uint64_t end) {
  add_counted(t, (end - t->run_start) / 4);
}

/* LOST records bt_writer.h wrote since `before` (its lost_events then). */
static void count_lost_since(BtThread *t, uint64_t before) {
  add_counted(t, BT_HDR64(&t->w, BT_OFF_LOST_EVENTS) - before);
}

/* Write one escape record through bt_writer.h, counted (with a LOST record it flushes
   first).  0, or -1 if drop mode dropped it. */
static int write_counted(BtThread *t, const uint64_t *words, unsigned n) {
  uint64_t lost = BT_HDR64(&t->w, BT_OFF_LOST_EVENTS);
  int dropped = bt_write(&t->w, words, n);
  count_lost_since(t, lost);
  if (!dropped)
    add_counted(t, 1);
  return dropped;
}

/* Slots the scratch chunk took while dropping. */
static uint64_t scratch_slots(BtThread *t) {
  return (WP(t) - SLOT_LEAD - (uint64_t)t->scratch) / 4;
}

/* The ring's pages are not mapped in as it is opened: on the disk filesystem DIR is
   usually on, MAP_POPULATE maps a shared file's pages read-only, so each page took a fault
   at its first write all the same, and mapping 18 MiB that way cost each new thread 2 ms
   (measured: 1.5-1.8 ms to map, then 11-13 ms for a first write to every page, against 9 ms
   for those writes alone); a short thread writes a few pages.  Past its first 256 KiB a
   thread maps the next MiB in one call as it comes within 256 KiB of it, which on tmpfs
   takes half the time of a fault per page (4.4 ms for 16 MiB against 9 ms), and on ext4
   the same.  A kernel before 5.14 refuses it: the pages then fault one by one. */
#define BT_POPULATE_BATCH (1UL << 20)
#define BT_POPULATE_LEAD (256UL << 10)
static void populate_ahead(BtThread *t) {
  if (t->populated >= t->populate_end || t->w.head + BT_POPULATE_LEAD < t->populated)
    return;
  uint64_t at = t->populated & t->w.mask;
  uint64_t len = BT_POPULATE_BATCH;
  if (len > t->populate_end - t->populated)
    len = t->populate_end - t->populated;
  if (len > t->w.size - at)
    len = t->w.size - at;
  if (syscall(28 /* madvise */, (uint8_t *)t->w.data + at, len, 23 /* MADV_POPULATE_WRITE */))
    t->populate_end = t->populated;
  else
    t->populated += len;
}

/* Point wp at a claimed chunk (or the scratch chunk when drop mode must drop). */
static void refill(BtThread *t) {
  int ok;
  if (t->closed) {
    WP(t) = (uint64_t)t->scratch + SLOT_LEAD;
    return;
  }
  /* every caller brought the head up to what it wrote and counted it: a thread killed
     while it waits here for the host to drain (stream mode) leaves an exact count */
  bt_publish(&t->w);
  publish_counted(t);
  uint64_t lost = BT_HDR64(&t->w, BT_OFF_LOST_EVENTS);
  if (t->w.pending_lost)
    ok = bt_flush_lost(&t->w, 1) == 0;
  else
    ok = bt_reserve(&t->w, 1) == 0;
  count_lost_since(t, lost);
  if (!ok) {
    t->dropping = 1;
    WP(t) = (uint64_t)t->scratch + SLOT_LEAD;
    return;
  }
  t->dropping = 0;
  populate_ahead(t);
  if (t->w.head == t->w.claim_end - BT_CHUNK) {
    /* a fresh chunk starts with the time (CLOCK_MONOTONIC): the anchors that place
       context switches, and any other timed event, among the blocks */
    long ts[2];
    clock_gettime(1 /* CLOCK_MONOTONIC */, ts);
    uint64_t stamp[2] = {bt_escape(BT_RECORDTYPE_TIME, 1, 0),
                         (uint64_t)(ts[0] * 1000000000L + ts[1]) & BT_PAYLOAD_MASK};
    bt_store(&t->w, stamp, 2);
    add_counted(t, 1);
  }
  t->run_start = t->w.head;
  WP(t) = (uint64_t)t->w.data + (t->w.head & t->w.mask) + SLOT_LEAD;
  publish_counted(t);
}

static void leave_c(BtThread *t);
static void close_ring(BtThread *t, int from_script);

/* Who moves a thread's head and `wp` other than by its inline records: the thread, in its
   C code, or the script's thread as the recording ends (bt_thread_close) -- one at a time.
   The script closed a thread's ring while the thread was inside a chunk claim (in stream
   mode, waiting for the host to drain): both moved the head, and the ring's count came out
   a chunk's slots (16,380) too high in 5 attaches of 6 to 8 busy threads (`loopers`, stream
   mode), and once in about 40 2^62 too high.  A signal
   handler that interrupts C code never enters it (in_c: its GAP is left due), so the lock
   is taken only by the outermost entry and the thread never waits for itself. */
static int try_lock_writer(BtThread *t) {
  int old = 1;
  __asm__ __volatile__("xchgl %0, %1" : "+r"(old), "+m"(t->writer_lock) : : "memory");
  return old == 0;
}

static void unlock_writer(BtThread *t) {
  bt_barrier();
  t->writer_lock = 0;
}

static void enter_c(BtThread *t) {
  if (t->in_c++ == 0)
    while (!try_lock_writer(t))
      __asm__ __volatile__("pause");
}

/* The lock goes before in_c: a handler entered in between leaves its GAP due, which
   leave_c writes.  A close the script asked for meanwhile is made here, by the thread. */
static void exit_c(BtThread *t) {
  if (t->in_c == 1) {
    unlock_writer(t);
    bt_full_barrier(); /* before close_requested is read: see bt_thread_close */
    if (t->close_requested && !t->closed && try_lock_writer(t)) {
      if (!t->closed)
        close_ring(t, 0);
      unlock_writer(t);
    }
  }
  t->in_c--;
}

static uint8_t *context_to_let_go(BtThread *t);
static void let_go_of_context(uint8_t *ctx);
static void release_thread(BtThread *t, int ended);

static void on_chunk_end(GumCpuContext *cpu, gpointer user_data) {
  BtThread *t = user_data;
  if (t->leaving && !t->left && t->closed) {
    t->left = 1;
    bt_barrier(); /* before `wp` moves (bt_thread_let_go) */
    uint8_t *ctx = context_to_let_go(t);
    if (ctx != NULL) {
      WP(t) = (uint64_t)t->scratch + BT_CHUNK; /* at a chunk's end: the block leaves */
      /* while Stalker keeps the context: unmapping a populated ring under load took over
         the 20 ms after which Stalker frees it, and this callout's stack was gone */
      release_thread(t, 0);
      let_go_of_context(ctx);
      return;
    }
  }
  enter_c(t);
  if (t->dropping || t->closed) {
    if (!t->closed)
      bt_lose(&t->w, scratch_slots(t));
  } else {
    count_slots(t, t->w.claim_end - SLOT_LEAD); /* the chunk's last slot stays empty */
    t->w.head = t->w.claim_end;
  }
  refill(t);
  leave_c(t); /* with the due GAPs of handlers that ran before the chunk's end */
}

static int bt_consumer_alive(struct bt_writer *w) {
  struct bt_flock lk = {1 /* F_WRLCK */, 0 /* SEEK_SET */, 1, 1, 0};
  return fcntl(w->fd, 36 /* F_OFD_GETLK */, &lk) == 0 && lk.l_type != 2 /* F_UNLCK */;
}

/* Thread state lives in its own mapping, never freed: blocks Stalker compiled for a
   thread point at it and may still run briefly after the agent is unloaded.  It is placed
   below 2 GiB when it can be, so that when the header page cannot be, `wp` is still a
   32-bit absolute address for the short sequences. */
BtThread *bt_thread_alloc(void) {
  uint8_t *p = mmap(NULL, 4096, 3 /* PROT_READ|WRITE */, 0x62 /* PRIVATE|ANON|32BIT */, -1, 0);
  if (p == (uint8_t *)-1)
    p = mmap(NULL, 4096, 3, 0x22 /* PRIVATE|ANONYMOUS */, -1, 0);
  return p == (uint8_t *)-1 ? NULL : (BtThread *)p;
}

/* In a forked child: stop writing into the parent's rings and drop their descriptors
   (the parent keeps the writer lock). */
void bt_thread_forget(BtThread *t) {
  if (t->closed)
    return;
  /* the child's writes must not reach the parent's header: a private page in its place,
     or (if that fails) the private `wp` for what C code writes */
  if (t->header32 != NULL &&
      mmap(t->header32, 4096, 3, 0x32 /* PRIVATE|FIXED|ANONYMOUS */, -1, 0) != t->header32)
    t->wpp = &t->wp;
  t->wpc = t->wpp; /* not the parent's header */
  t->held_sig = 0; /* the parent's */
  t->closed = 1;
  WP(t) = (uint64_t)t->scratch + SLOT_LEAD;
  close(t->w.fd);
}

/* The agent finds a thread's state by its slot (current_thread, and a forked child lets go
   of every ring there), so a thread without one would not be traced exactly: a thread that
   ends gives its slot back (release_thread) for the next one.  A spin lock on
   g_atomic_int_add; it is held for a short scan. */
static void lock_slots(void) {
  while (g_atomic_int_add(&STATE->slots_lock, 1) != 0)
    g_atomic_int_add(&STATE->slots_lock, -1);
}

static void unlock_slots(void) {
  g_atomic_int_add(&STATE->slots_lock, -1);
}

static int take_slot(BtThread *t, uint32_t tid) {
  lock_slots();
  int n = STATE->nthreads, slot = n;
  for (int i = 0; i < n; i++) {
    BtThread *other = STATE->threads[i];
    /* a thread with this id ended unseen (the kernel gives a new thread only the id of an
       ended one): its slot goes, or current_thread would find it for the new thread */
    if (other != NULL && other->tid == tid)
      STATE->threads[i] = other = NULL;
    if (other == NULL && slot == n)
      slot = i;
  }
  if (slot < BT_MAX_THREADS) {
    STATE->threads[slot] = t;
    if (slot == n)
      g_atomic_int_add(&STATE->nthreads, 1);
  }
  unlock_slots();
  return slot < BT_MAX_THREADS;
}

static void give_back_slot(BtThread *t) {
  lock_slots();
  for (int i = 0; i < STATE->nthreads; i++)
    if (STATE->threads[i] == t)
      STATE->threads[i] = NULL;
  unlock_slots();
}

static int open_ring(BtThread *t, const char *path, uint32_t tid);

#define BT_NO_SLOT 100000 /* bt_thread_open(): more threads at once than slots */

/* Map the store at `path` for thread `tid` and take the writer lock.  0, -errno, or
   -BT_NO_SLOT. */
int bt_thread_open(BtThread *t, const char *path, uint32_t tid) {
  if (!take_slot(t, tid))
    return -BT_NO_SLOT;
  int rc = open_ring(t, path, tid);
  if (rc != 0)
    give_back_slot(t);
  return rc;
}

static int open_ring(BtThread *t, const char *path, uint32_t tid) {
  int fd = open(path, 2 /* O_RDWR */ | 02000000 /* O_CLOEXEC */);
  if (fd < 0)
    return -*__errno_location();
  struct bt_flock lk = {1 /* F_WRLCK */, 0 /* SEEK_SET */, 0, 1, 0};
  if (fcntl(fd, 37 /* F_OFD_SETLK */, &lk) != 0) {
    close(fd);
    return -16; /* EBUSY */
  }
  uint64_t size = (uint64_t)lseek(fd, 0, 2 /* SEEK_END */);
  /* Reserve room to place the data area (which starts 4096 bytes into the file) on a
     64 KiB boundary, then map the file there. */
  uint64_t reserve_size = size + 2 * BT_CHUNK;
  uint8_t *reserve = mmap(NULL, reserve_size, 0 /* PROT_NONE */,
                          0x22 | 0x4000 /* MAP_PRIVATE|ANONYMOUS|NORESERVE */, -1, 0);
  if (reserve == (uint8_t *)-1) {
    close(fd);
    return -12;
  }
  uint8_t *base = align_up(reserve + BT_HEADER_SIZE, BT_CHUNK) - BT_HEADER_SIZE;
  uint8_t *map = mmap(base, size, 3 /* PROT_READ|WRITE */,
                      0x01 | 0x10 /* MAP_SHARED|FIXED: see populate_ahead */, fd, 0);
  if (map != base) {
    munmap(reserve, reserve_size);
    close(fd);
    return -12;
  }
  uint64_t table_offset = ((uint64_t *)map)[BT_OFF_TABLE_OFFSET / 8];
  uint64_t table_size = ((uint64_t *)map)[BT_OFF_TABLE_SIZE / 8];
  if (bt_writer_init(&t->w, map, fd, 0, (uint32_t)getpid()) || t->w.chunk != BT_CHUNK ||
      table_size < 16 || table_offset + table_size > size) {
    munmap(reserve, reserve_size);
    close(fd);
    return -22;
  }
  t->table = (uint64_t *)(map + table_offset);
  t->table_cap = table_size / 8;
  t->next_id = BT_HDR64(&t->w, BT_OFF_TABLE_COUNT);
  if (t->next_id == 0)
    t->next_id = 1;
  /* The write pointer lives in the shared header, below 2 GiB for the short sequences, so
     a reader finds where the records end once this process is gone without the chunks
     being zeroed.  Failing that, in BtThread, and chunks are zeroed. */
  t->header32 = mmap(NULL, 4096, 3, 0x41 /* SHARED|32BIT */, fd, 0);
  if (t->header32 == (uint8_t *)-1) {
    t->header32 = NULL;
    t->wpp = t->wpc = &t->wp;
  } else {
    t->wpp = (uint64_t *)(t->header32 + BT_OFF_INLINE_PTR);
    t->wpc = (uint64_t *)(map + BT_OFF_INLINE_PTR);
    t->w.zero_chunks = 0;
    BT_HDR64(&t->w, BT_OFF_INLINE_BASE) = (uint64_t)t->w.data;
  }
  t->scratch_area = mmap(NULL, 2 * BT_CHUNK, 3, 0x22, -1, 0);
  t->scratch = align_up(t->scratch_area, BT_CHUNK);
  t->tid = tid;
  t->dropping = 0;
  t->closed = 0;
  t->close_requested = 0;
  t->writer_lock = 0;
  t->map_size = size;
  t->reserve = reserve;
  t->reserve_size = reserve_size;
  BT_HDR32(&t->w, BT_OFF_TID) = tid;
  t->populated = t->w.head + BT_POPULATE_LEAD + BT_POPULATE_LEAD;
  t->populate_end = t->w.head + t->w.size;
  refill(t);
  return 0;
}

static void write_gap(BtThread *t, uint32_t reason) {
  uint64_t gap = bt_escape(BT_RECORDTYPE_GAP, 0, reason);
  if (write_counted(t, &gap, 1) == 0) {
    uint64_t at = reason == BT_GAPREASON_FORK     ? BT_OFF_COUNTED_GAP_FORK
                  : reason == BT_GAPREASON_SIGNAL ? BT_OFF_COUNTED_GAP_SIGNAL
                                                  : BT_OFF_COUNTED_GAP_LEFT_HANDLER;
    BT_HDR64(&t->w, at) = BT_HDR64(&t->w, at) + 1;
  }
}

/* The GAPs of signal handlers that ran while this thread was in the agent's C code or
   about to enter it (see bt_on_handler_entry), written here, with the head in place. */
static void write_pending_gaps(BtThread *t) {
  while (t->signal_gaps_done != t->signal_gaps_due) {
    write_gap(t, BT_GAPREASON_SIGNAL);
    t->signal_gaps_done++;
  }
}

/* Bring the writer's head up to the inline write pointer (or count what the scratch chunk
   took while dropping), before C code writes or publishes. */
static void sync_head_to(BtThread *t, uint64_t end) {
  if (t->dropping) {
    bt_lose(&t->w, scratch_slots(t));
  } else {
    count_slots(t, end);
    t->w.head = (end + 7) & ~7ULL; /* a word's empty high slot was stored as zero */
  }
  write_pending_gaps(t);
}

static void sync_head(BtThread *t) {
  sync_head_to(t, t->dropping ? 0 : wp_position(t));
}

/* The end of C code that moves the head or `wp`: the GAPs of handlers that ran meanwhile
   (bt_on_handler_entry left them pending) go here, where they ran, since nothing was
   written after; a handler that runs once in_c is down writes its own. */
static void leave_c(BtThread *t) {
  for (;;) {
    exit_c(t);
    if (t->signal_gaps_done == t->signal_gaps_due || t->closed)
      return;
    enter_c(t);
    if (!t->closed) {
      sync_head(t);
      refill(t);
    }
  }
}

/* Publish everything and let go of the ring, with the writer lock held.  From the script's
   thread (`from_script`) the traced thread may be in the middle of a record: it read `wp`
   before we did and stores its slot where `wp` says the next one goes, which in the high
   half of the last word would be published uncounted (a thread or two in 7 attaches of 8
   to `loopers`).  So the trace ends at the last whole word then, a slot before at most. */
static void close_ring(BtThread *t, int from_script) {
  uint64_t end = t->dropping ? 0 : wp_position(t);
  if (from_script && (WP(t) & (BT_CHUNK - 1)) != 0 /* else its chunk's callout is next */)
    end &= ~7ULL;
  sync_head_to(t, end);
  t->closed = 1;
  WP(t) = (uint64_t)t->scratch + SLOT_LEAD;
  uint64_t lost = BT_HDR64(&t->w, BT_OFF_LOST_EVENTS);
  bt_writer_close(&t->w); /* may write a last LOST record */
  count_lost_since(t, lost);
  close(t->w.fd); /* releases the writer lock */
}

/* The thread ends: it closes its own ring. */
static void close_own_ring(BtThread *t) {
  enter_c(t);
  if (!t->closed)
    close_ring(t, 0);
  exit_c(t);
}

static int64_t monotonic_ns(void) {
  long ts[2];
  clock_gettime(1 /* CLOCK_MONOTONIC */, ts);
  return ts[0] * 1000000000L + ts[1];
}

/* When the script's closes of the rings at the end of the recording stop waiting
   (bt_thread_close): 0.25 s from now. */
int64_t bt_close_deadline(void) {
  return monotonic_ns() + 250000000L;
}

/* The script closes a thread's ring as the recording ends, from its own thread, once the
   traced thread is out of its C code; that waits for the host to drain, in stream mode,
   which it does meanwhile.  A thread still inside at `deadline` (bt_close_deadline, one for
   all the threads: a process stopped with SIGSTOP) is asked to close it as it leaves
   (exit_c), and the script goes on: each side sets its own flag, then a full barrier, then
   reads the other's, so one of the two does.  A deadline in time, not in rounds of 0.1 ms:
   on a loaded machine each nanosleep() takes milliseconds, and 2,500 rounds for each of 8
   threads took over 30 s (`loopers`, 4 of its threads busy, beside 4 to 6 other busy
   processes on 2 CPUs): the host gave up on the agent, and a ring stayed mapped in the
   program. */
void bt_thread_close(BtThread *t, int64_t deadline) {
  while (!t->closed) {
    int late = monotonic_ns() >= deadline;
    if (late) {
      t->close_requested = 1;
      bt_full_barrier();
    }
    if (try_lock_writer(t)) {
      if (!t->closed)
        close_ring(t, 1);
      unlock_writer(t);
      return;
    }
    if (late)
      return;
    long pause_ns[2] = {0, 100000};
    syscall(35 /* nanosleep */, pause_ns, NULL);
  }
}

/* Stalker lets go of a thread only where the thread passes through Stalker's own code (an
   entry gate), and the blocks it compiled jump straight to one another once backpatched: a
   thread looping in them after Stalker.unfollow() ran on under Stalker, slower, with the
   agent loaded, for as long as the loop lasted (a program calling usleep() in a loop, after
   a detach: still there 10 s later).  CModule has no Gum call that sends a thread through
   a gate (invalidating its blocks, or a chaining return), so each block leaves by itself:
   after its chunk callout, a block whose `wp` is left at a chunk's end jumps to its own
   start, natively, and so runs on outside Stalker with the program's registers (see
   put_leave).  The callout first does for Stalker what its gate would have done: it marks
   the thread's GumExecCtx destroy-pending, so that Stalker frees it 20 ms later and Frida
   can unload the agent.  That is Gum's private layout, so only when it reads back as
   expected: the GumStalker that widen_inline_cache() checked, this thread's id, and the
   unfollow that Stalker.unfollow() asked for.  Otherwise the thread stays, as before.
   (Gum also clears its thread-local pointer to the context there, which CModule cannot
   reach; Gum reads it only as the thread enters Stalker again, which it never does.) */
static uint8_t *context_to_let_go(BtThread *t) {
  uint8_t *ctx = t->exec_ctx;
  if (STATE->stalker == NULL || ctx == NULL || *(uint8_t **)(ctx + 16) != STATE->stalker
      || *(uint64_t *)(ctx + 24) != t->tid)
    return NULL;
  return *(volatile int *)ctx == 1 /* GUM_EXEC_CTX_UNFOLLOW_PENDING */ ? ctx : NULL;
}

/* Stalker frees the context 20 ms from now, and the stack its callouts run on with it: the
   last thing a callout does before it returns. */
static void let_go_of_context(uint8_t *ctx) {
  long ts[2];
  clock_gettime(1 /* CLOCK_MONOTONIC, as g_get_monotonic_time() */, ts);
  *(int64_t *)(ctx + 8) = ts[0] * 1000000L + ts[1] / 1000; /* destroy_pending_since */
  bt_barrier();
  *(volatile int *)ctx = 2; /* GUM_EXEC_CTX_DESTROY_PENDING */
}

static void compare_and_swap(uint64_t *p, uint64_t expected, uint64_t desired) {
  __asm__ __volatile__("lock cmpxchgq %2, %1"
                       : "+a"(expected), "+m"(*p)
                       : "r"(desired)
                       : "memory", "cc");
}

/* The recording has ended and the thread's ring is closed (bt_thread_close): its next
   block's record lands on a chunk's end, in the scratch chunk, and so calls on_chunk_end.
   The thread may be between its read and its write of `wp`, and then moves it on from
   where it was (the scratch chunk, or the ring just closed): it reaches a chunk callout
   after 16,384 blocks at most, and the script calls this again meanwhile.  Returns
   whether that callout has come. */
int bt_thread_let_go(BtThread *t) {
  if (t->left || t->reserve == NULL /* it ended */)
    return 1;
  t->leaving = 1;
  if (!t->closed) /* it closes its ring as it leaves its C code (bt_thread_close): `wp` */
    return 0;     /* is where its records end until then */
  uint64_t last_slot = (uint64_t)t->scratch + BT_CHUNK - SLOT_LEAD;
  uint64_t seen = WP(t);
  bt_barrier();
  /* The thread may be leaving right now: it sets `left`, then `wp` to the chunk's end
     (which its block tests next), then unmaps its scratch chunk.  `wp` set back to the
     last slot after that would send it on in Stalker, writing into the unmapped chunk.  So
     `left` is read after `wp` (x86 keeps both loads, and both of its stores, in order),
     and `wp` changes only if it is still what was read. */
  if (t->left)
    return 1;
  if (seen != last_slot)
    compare_and_swap(t->wpp, seen, last_slot);
  return 0;
}

/* The address in the program of the system call instruction the thread last entered (0:
   none), for the host when the thread is asleep in that call at the end of a recording:
   its registers there are the program's, so the host can move it out of Stalker's copy of
   the instruction to the instruction itself (asleep.py). */
uint64_t bt_thread_asleep_at(BtThread *t) {
  return t->syscall_at;
}

/* The agent's signal stack armed in the thread (arm_altstack), or 0, for the host, which
   disarms it in a thread it moves out of Stalker asleep (asleep.py). */
uint64_t bt_thread_altstack(BtThread *t) {
  return (uint64_t)t->altstack;
}

/* The host has let go of the thread, stopped asleep in a system call (asleep.py): it moved
   it out of Stalker's code (`moved`: Stalker may free what it keeps for the thread, as once
   it leaves by itself), or found it in the program's own code with nothing of Frida's on
   its stack.  Either way it runs no more compiled code, and its mappings go.  Whether
   Stalker's context for it was let go of too (`moved`), or 1.  `disarmed`: the host
   disarmed the agent's signal stack in the thread, which the thread cannot do itself
   (disarm_altstack), and it goes too; else it stays armed, with its memory. */
int bt_thread_let_go_asleep(BtThread *t, int moved, int disarmed) {
  if (disarmed && t->altstack != NULL) {
    munmap(t->altstack - BT_GUARD, BT_GUARD + BT_ALTSTACK_SIZE);
    t->altstack = NULL;
  }
  if (t->left)
    return 1;
  t->left = 1;
  uint8_t *ctx = moved ? context_to_let_go(t) : NULL;
  if (ctx != NULL)
    let_go_of_context(ctx);
  release_thread(t, 0);
  return !moved || ctx != NULL;
}

static BtThread *current_thread(void) {
  uint32_t tid = (uint32_t)syscall(186 /* gettid */);
  for (int i = 0; i < STATE->nthreads; i++) {
    BtThread *t = STATE->threads[i];
    if (t != NULL && t->tid == tid && !t->closed)
      return t;
  }
  return NULL;
}

/* Mark that the thread is about to run untraced code (a GAP record). */
void bt_thread_gap(BtThread *t, uint32_t reason) {
  if (t->closed)
    return;
  enter_c(t);
  if (!t->closed) {
    sync_head(t);
    write_gap(t, reason);
    refill(t);
  }
  leave_c(t);
}

/* A stack overflow left no room for the kernel's signal frame on the thread's stack: it
   killed the process at once, on_fault() never ran, and the trace ended "within" the last
   block.  So each traced thread to which the program gave no signal stack gets one of the
   agent's, armed as the thread compiles its first block, on which on_fault() runs and
   writes the FAULT.  SS_AUTODISARM: a handler entered on it disarms it until it returns, so
   a signal inside that handler lands on the stack the handler runs on, as without it.  The
   program's handlers do not run there (run_on_thread_stack): to the program the thread has
   no signal stack, as before. */

static int on_altstack(const BtThread *t) {
  uint8_t here;
  return t->altstack != NULL && &here >= t->altstack && &here < t->altstack + BT_ALTSTACK_SIZE;
}

/* The agent's signal stack that a thread has, by its memory: its own, or in a forked child
   its parent's thread's (the child inherits the setting and a copy of the memory). */
static uint8_t *agents_altstack(const void *sp) {
  for (int i = 0; i < STATE->nthreads; i++)
    if (STATE->threads[i] != NULL && STATE->threads[i]->altstack == sp && sp != NULL)
      return (uint8_t *)sp;
  return NULL;
}

static void arm_altstack(BtThread *t) {
  if ((uint32_t)syscall(186 /* gettid */) != t->tid)
    return; /* attached: Stalker compiles the first block where the thread was followed from */
  t->altstack_tried = 1;
  BtStack now;
  if (syscall(131 /* sigaltstack */, NULL, &now) != 0 || !(now.flags & BT_SS_DISABLE))
    return; /* the program's own */
  uint8_t *area = mmap(NULL, BT_GUARD + BT_ALTSTACK_SIZE, 3 /* PROT_READ|WRITE */,
                       0x22 | 0x4000 /* PRIVATE|ANONYMOUS|NORESERVE */, -1, 0);
  if (area == (uint8_t *)-1)
    return;
  syscall(10 /* mprotect */, area, BT_GUARD, 0 /* PROT_NONE: what overflows it faults */);
  BtStack mine = {area + BT_GUARD, BT_SS_AUTODISARM, BT_ALTSTACK_SIZE};
  if (syscall(131, &mine, NULL) != 0) {
    munmap(area, BT_GUARD + BT_ALTSTACK_SIZE);
    return;
  }
  t->altstack = area + BT_GUARD;
}

/* The thread is done with the agent (it exits, or leaves Stalker for good): its signal
   stack is disarmed and goes.  Not while something runs on it, and not when the program
   has set its own since (unless the thread ends): a handler of the program's, run
   untraced, may have been shown the agent's and may set it again. */
static void disarm_altstack(BtThread *t, int ended) {
  BtStack now, off = {NULL, BT_SS_DISABLE, 0};
  if (t->altstack == NULL || on_altstack(t) || syscall(131, NULL, &now) != 0)
    return;
  if (now.sp == t->altstack ? syscall(131, &off, NULL) != 0 : !ended)
    return;
  munmap(t->altstack - BT_GUARD, BT_GUARD + BT_ALTSTACK_SIZE);
  t->altstack = NULL;
}

/* A handler entered on the agent's stack disarmed it (SS_AUTODISARM), and one that leaves
   by siglongjmp() does not arm it again as a return would: armed again, unless the
   program has set a stack of its own meanwhile. */
static void rearm_altstack(BtThread *t) {
  BtStack now, mine = {t->altstack, BT_SS_AUTODISARM, BT_ALTSTACK_SIZE};
  if (t->altstack != NULL && !on_altstack(t) && syscall(131, NULL, &now) == 0 &&
      (now.flags & BT_SS_DISABLE))
    syscall(131, &mine, NULL);
}

/* Before a sigaltstack() system call (put_syscall_checks): the program is not shown the
   agent's stack.  Asked which it has, it is told none, as without the agent (Rust's
   runtime, shown one, set none of its own, and its handler, run on the thread's stack,
   could not say that the stack overflowed); one it sets takes the agent's place.  The old
   stack is written here, and the call itself writes none (when it fails, that is written
   all the same). */
static void on_sigaltstack(GumCpuContext *cpu, gpointer user_data) {
  BtThread *t = user_data;
  BtStack now, none = {NULL, BT_SS_DISABLE, 0};
  uint64_t local[2] = {(uint64_t)&none, sizeof none}, remote[2] = {cpu->rsi, sizeof none};
  if (cpu->rsi != 0 && t->altstack != NULL && syscall(131, NULL, &now) == 0 &&
      now.sp == t->altstack &&
      syscall(311 /* process_vm_writev */, getpid(), local, 1, remote, 1, 0) == sizeof none)
    cpu->rsi = 0;
}

/* In a forked child, which runs on untraced: the parent's signal stack it inherited goes. */
static void disarm_inherited_altstack(void) {
  BtStack now, off = {NULL, BT_SS_DISABLE, 0};
  uint8_t *inherited;
  if (syscall(131, NULL, &now) == 0 && (inherited = agents_altstack(now.sp)) != NULL &&
      syscall(131, &off, NULL) == 0)
    munmap(inherited - BT_GUARD, BT_GUARD + BT_ALTSTACK_SIZE);
}

/* In a forked child: the parent's rings it inherited, shared mappings of the trace
   directory's files, become private memory in place.  The child never writes them
   (bt_thread_forget), but kept them mapped for its whole life: every ring, the one of a
   thread that started as the program forked (in no slot yet) included, so the files stayed
   held after the directory was deleted, and a later `record -p` of the child was refused
   as if the child were traced.  Private memory rather than a hole: code compiled for the
   forking thread may still read a ring's header until Frida's flush.  A ring named for
   the child's own thread is left alone (the script a child's child is given may be in
   before this runs).  The ranges are collected first: /proc/self/maps changing while it is
   read could skip a line. */
#define BT_RINGS_AT_ONCE 64

static uint64_t parse_hex(const char **p) {
  uint64_t v = 0;
  for (;; (*p)++) {
    char c = **p;
    int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (digit < 0)
      return v;
    v = v << 4 | (uint64_t)digit;
  }
}

static uint64_t parse_decimal(const char *p) {
  uint64_t v = 0;
  for (; *p >= '0' && *p <= '9'; p++)
    v = v * 10 + (uint64_t)(*p - '0');
  return v;
}

static int ends_with(const char *from, const char *end, const char *suffix) {
  long n = 0;
  while (suffix[n] != '\0')
    n++;
  if (end - from < n)
    return 0;
  for (long i = 0; i < n; i++)
    if (end[i - n] != suffix[i])
      return 0;
  return 1;
}

/* Whether `line` (one line of /proc/self/maps, NUL-ended) maps a ring of another thread
   shared; its range in `range`. */
static int foreign_ring(const char *line, uint32_t own_tid, uint64_t *range) {
  const char *p = line, *name = NULL, *end;
  range[0] = parse_hex(&p);
  if (*p++ != '-')
    return 0;
  range[1] = parse_hex(&p);
  if (p[0] != ' ' || p[4] != 's') /* "rw-s": a shared mapping */
    return 0;
  for (end = p; *end != '\0'; end++)
    if (*end == '/')
      name = end + 1;
  if (name == NULL || name[0] != 'T')
    return 0;
  if (ends_with(name, end, " (deleted)"))
    end -= 10;
  if (!ends_with(name, end, ".bts"))
    return 0;
  return parse_decimal(name + 1) != own_tid;
}

/* Calls visit(line, ctx) on each line of /proc/self/maps (NUL-ended, read into `buf`: on
   the stack, a CModule's static memory is not writable) until it returns 0. */
static void each_mapping(int (*visit)(const char *line, void *ctx), void *ctx, char *buf,
                         long size) {
  long fd = syscall(2 /* open */, "/proc/self/maps", 0 /* O_RDONLY */);
  if (fd < 0)
    return;
  long kept = 0, n;
  int more = 1;
  while (more && (n = syscall(0 /* read */, fd, buf + kept, size - kept)) > 0) {
    long len = kept + n, from = 0;
    for (long i = 0; more && i < len; i++) {
      if (buf[i] != '\n')
        continue;
      buf[i] = '\0';
      more = visit(buf + from, ctx);
      from = i + 1;
    }
    kept = len - from; /* a line cut off by the read: to the front */
    if (kept == size)
      kept = 0; /* a line longer than the buffer: none of interest */
    for (long i = 0; i < kept; i++)
      buf[i] = buf[from + i];
  }
  syscall(3 /* close */, fd);
}

typedef struct {
  uint32_t own_tid;
  int n_found;
  uint64_t (*found)[2];
} BtRingSearch;

static int visit_for_rings(const char *line, void *ctx) {
  BtRingSearch *search = ctx;
  if (foreign_ring(line, search->own_tid, search->found[search->n_found]))
    search->n_found++;
  return search->n_found < BT_RINGS_AT_ONCE;
}

/* Up to BT_RINGS_AT_ONCE ranges into `found`. */
static int find_inherited_rings(uint64_t (*found)[2], char *buf, long size) {
  BtRingSearch search = {(uint32_t)getpid(), 0, found};
  each_mapping(visit_for_rings, &search, buf, size);
  return search.n_found;
}

static void make_private(uint64_t (*rings)[2], int n) {
  for (int i = 0; i < n; i++)
    mmap((void *)rings[i][0], rings[i][1] - rings[i][0], 3 /* PROT_READ|WRITE */,
         0x32 /* PRIVATE|FIXED|ANONYMOUS */, -1, 0);
}

/* Every inherited ring, those past the first BT_RINGS_AT_ONCE included (leave_parents_trace). */
static void drop_inherited_rings(void) {
  char buf[4096];
  uint64_t found[BT_RINGS_AT_ONCE][2];
  int n;
  do {
    n = find_inherited_rings(found, buf, sizeof buf - 1);
    make_private(found, n);
  } while (n == BT_RINGS_AT_ONCE);
}

/* A forked child that is not followed (no --follow-fork) runs on untraced, but kept every
   hook Frida put into the program's code and the libraries': its calls of fork(),
   sigaction(), exit() and its threads' starts and ends (Frida's thread registry) went on
   through Gum's trampolines into the agent's copy, whose locks may be held for good by
   threads the child does not have.  A `record -p` of such a child hung in 2 of 20 tries:
   a thread of the new agent, ending, ran a destructor of the old agent's (set as it
   started, through the old agent's hook in start_thread()), which waited for GLib's
   type lock, write-locked in the parent as it forked.  So the child puts back each page
   of code that a hook changed, mapping it again from its file: it then runs none of the
   tracer's code.  The pages are noted in the traced process, once its hooks are in: a
   page of a file's executable mapping that is no longer the file's (the kernel's page map:
   present, not a file page), where every byte that differs from the file lies in a hook
   of Frida's (a jump into Frida's code, and the rest of the instructions it overwrote).
   A page that the program changed itself is left as it is. */
#define BT_HOOK_SPAN 32 /* a hook's jump and the rest of the instructions it overwrote */

static int read_safely(const void *addr, void *out, uint64_t n);

/* A private executable mapping of a file, from one line of /proc/self/maps: its path
   (NUL-ended), or NULL for any other mapping. */
static const char *code_mapping(const char *line, uint64_t *start, uint64_t *end,
                                uint64_t *offset, uint64_t *inode) {
  const char *p = line, *path, *path_end;
  *start = parse_hex(&p);
  if (*p++ != '-')
    return NULL;
  *end = parse_hex(&p);
  if (p[0] != ' ' || p[3] != 'x' || p[4] != 'p') /* " r-xp" */
    return NULL;
  p += 6;
  *offset = parse_hex(&p);
  while (*p == ' ')
    p++;
  while (*p != ' ' && *p != '\0') /* the device */
    p++;
  while (*p == ' ')
    p++;
  *inode = parse_decimal(p);
  for (path = p; *path != '\0' && *path != '/'; path++)
    ;
  for (path_end = path; *path_end != '\0'; path_end++)
    ;
  if (*path != '/' || ends_with(path, path_end, " (deleted)"))
    return NULL;
  return path;
}

/* Where a hook's first instruction at `at` jumps to (jmp rel32, or jmp [rip+disp32]), or 0. */
static uint64_t hook_target(uint64_t at) {
  uint8_t insn[6];
  uint64_t target;
  if (!read_safely((void *)at, insn, sizeof insn))
    return 0;
  int32_t rel = (int32_t)(insn[1] | insn[2] << 8 | insn[3] << 16 | (uint32_t)insn[4] << 24);
  int32_t disp = (int32_t)(insn[2] | insn[3] << 8 | insn[4] << 16 | (uint32_t)insn[5] << 24);
  if (insn[0] == 0xe9)
    return at + 5 + (int64_t)rel;
  if (insn[0] == 0xff && insn[1] == 0x25 &&
      read_safely((void *)(at + 6 + (int64_t)disp), &target, 8))
    return target;
  return 0;
}

/* is_frida_code() without the fork turn: called from the script itself, which holds its
   lock already (bt_note_hooked_pages). */
static int fridas_code(uint64_t address) {
  const BtCodeRange *range = code_range(address);
  return range != NULL ? (int)range->fridas : bt_is_frida_code(address);
}

typedef struct {
  long pagemap;
  int n;
  uint64_t pages[BT_HOOKED_PAGES];
  uint64_t hooked_until; /* the end of the last hook seen: it may go on into the next page */
  uint8_t file[4096];
  uint64_t entries[512];
  char maps[4096];
} BtHookSearch;

/* Whether the page at `page` differs from `file` (its file's bytes) in Frida's hooks only,
   and in one at least. */
static int changed_by_hooks(BtHookSearch *search, uint64_t page) {
  const uint8_t *now = (const uint8_t *)page;
  int hooks = 0;
  for (int i = 0; i < 4096; i++) {
    if (now[i] == search->file[i] || page + i < search->hooked_until)
      continue;
    uint64_t target = hook_target(page + i);
    if (target == 0 || !fridas_code(target))
      return 0;
    search->hooked_until = page + i + BT_HOOK_SPAN;
    hooks++;
  }
  return hooks > 0;
}

static int visit_for_hooks(const char *line, void *ctx) {
  BtHookSearch *search = ctx;
  uint64_t start, end, offset, inode;
  const char *path = code_mapping(line, &start, &end, &offset, &inode);
  if (path == NULL)
    return 1;
  long fd = -1;
  for (uint64_t at = start; at < end && search->n < BT_HOOKED_PAGES; at += 512 * 4096) {
    uint64_t n = (end - at) / 4096 < 512 ? (end - at) / 4096 : 512;
    if (syscall(17 /* pread64 */, search->pagemap, search->entries, 8 * n, (at >> 12) * 8)
        != (long)(8 * n))
      break;
    for (uint64_t i = 0; i < n && search->n < BT_HOOKED_PAGES; i++) {
      uint64_t entry = search->entries[i], page = at + 4096 * i;
      /* present and no longer the file's page, or swapped out (only changed pages are) */
      if (!((entry >> 63 & 1 && !(entry >> 61 & 1)) || entry >> 62 & 1))
        continue;
      if (fd < 0 && (fd = syscall(2 /* open */, path, 0x80000 /* O_RDONLY|O_CLOEXEC */)) < 0)
        return 1;
      long got = syscall(17 /* pread64 */, fd, search->file, 4096, offset + (page - start));
      for (long j = got < 0 ? 0 : got; j < 4096; j++)
        search->file[j] = 0; /* past the file's end a mapping reads zeros */
      if (changed_by_hooks(search, page))
        search->pages[search->n++] = page;
    }
  }
  if (fd >= 0)
    syscall(3 /* close */, fd);
  return search->n < BT_HOOKED_PAGES;
}

/* In the traced process, after hooks were added: notes the pages a child puts back.
   Returns how many. */
int bt_note_hooked_pages(void) {
  /* not on the stack: a hook may be added on a thread of the program's, whose stack may be
     small */
  BtHookSearch *search = mmap(NULL, sizeof(BtHookSearch), 3, 0x22 /* PRIVATE|ANONYMOUS */,
                              -1, 0);
  if (search == (BtHookSearch *)-1)
    return 0;
  search->n = 0;
  search->hooked_until = 0;
  search->pagemap = syscall(2 /* open */, "/proc/self/pagemap", 0x80000);
  if (search->pagemap >= 0) {
    each_mapping(visit_for_hooks, search, search->maps, sizeof search->maps - 1);
    syscall(3 /* close */, search->pagemap);
    /* a child forked meanwhile puts back fewer pages, not others */
    g_atomic_int_add(&STATE->nhooked_pages, -STATE->nhooked_pages);
    for (int i = 0; i < search->n; i++)
      STATE->hooked_pages[i] = search->pages[i];
    g_atomic_int_add(&STATE->nhooked_pages, search->n);
  }
  int n = search->n;
  munmap(search, sizeof(BtHookSearch));
  return n;
}

/* What a forked child finds in one pass over /proc/self/maps (each read of it took some
   0.1 ms): its parent's rings, and, if it puts its code back, the files of the hooked pages,
   opened there (once per mapping) and mapped after the pass, since /proc/self/maps changing
   while it is read could skip a line. */
typedef struct {
  BtRingSearch rings;
  int unhook;
  long fds[BT_HOOKED_PAGES];      /* the page's file, or -1 */
  int owns_fd[BT_HOOKED_PAGES];   /* opened for this page: closed with it */
  uint64_t offsets[BT_HOOKED_PAGES];
} BtChildScan;

static int visit_in_child(const char *line, void *ctx) {
  BtChildScan *scan = ctx;
  uint64_t start, end, offset, inode, st[18];
  const char *path;
  long fd = -1;
  if (scan->rings.n_found < BT_RINGS_AT_ONCE)
    visit_for_rings(line, &scan->rings);
  if (!scan->unhook || (path = code_mapping(line, &start, &end, &offset, &inode)) == NULL)
    return 1;
  for (int i = 0; i < STATE->nhooked_pages; i++) {
    uint64_t page = STATE->hooked_pages[i];
    if (page < start || page >= end || scan->fds[i] >= 0)
      continue;
    if (fd < 0) {
      fd = syscall(2 /* open */, path, 0x80000 /* O_RDONLY|O_CLOEXEC */);
      /* the file mapped, not one put in its place since (st_ino) */
      if (fd >= 0 && (syscall(5 /* fstat */, fd, st) != 0 || st[1] != inode)) {
        syscall(3 /* close */, fd);
        return 1;
      }
      if (fd < 0)
        return 1;
      scan->owns_fd[i] = 1;
    }
    scan->fds[i] = fd;
    scan->offsets[i] = offset + (page - start);
  }
  return 1;
}

static const int fault_signals[BT_FAULT_SIGNALS];

/* Frida's exceptor keeps the fault signals in the kernel (a child that faulted ran Frida's
   handler, in the agent's copy, before its own): they go back to what the program asked
   for (BtState.program), or to the default. */
static void restore_program_fault_handlers(void) {
  for (int i = 0; i < BT_FAULT_SIGNALS; i++) {
    BtSigaction now, program = {NULL, 0, NULL, 0};
    const BtCodeRange *range;
    if (syscall(13 /* rt_sigaction */, fault_signals[i], NULL, &now, 8) != 0 ||
        (range = code_range((uint64_t)now.handler)) == NULL || !range->fridas)
      continue;
    if (STATE->program_known >> i & 1) {
      program = STATE->program[i];
      if ((uint64_t)program.handler > 1) {
        program.flags |= 0x04000000; /* SA_RESTORER: the C library's, as Frida's had */
        program.restorer = now.restorer;
      }
    }
    syscall(13 /* rt_sigaction */, fault_signals[i], &program, NULL, 8);
  }
}

/* In a forked child: its parent's rings become private memory, and, when it is not
   followed, its code is put back as its files have it (unhook_children). */
static void leave_parents_trace(int unhook) {
  char buf[4096];
  BtChildScan scan;
  int n = unhook ? STATE->nhooked_pages : 0;
  scan.rings.own_tid = (uint32_t)getpid();
  scan.rings.n_found = 0;
  uint64_t rings[BT_RINGS_AT_ONCE][2];
  scan.rings.found = rings;
  scan.unhook = unhook;
  for (int i = 0; i < n; i++) {
    scan.fds[i] = -1;
    scan.owns_fd[i] = 0;
  }
  each_mapping(visit_in_child, &scan, buf, sizeof buf - 1);
  make_private(rings, scan.rings.n_found);
  if (scan.rings.n_found == BT_RINGS_AT_ONCE)
    drop_inherited_rings(); /* the rest */
  for (int i = 0; i < n; i++)
    if (scan.fds[i] >= 0)
      mmap((void *)STATE->hooked_pages[i], 4096, 5 /* PROT_READ|EXEC */,
           0x12 /* PRIVATE|FIXED */, scan.fds[i], scan.offsets[i]);
  for (int i = 0; i < n; i++)
    if (scan.owns_fd[i])
      syscall(3 /* close */, scan.fds[i]);
}

/* fork(): Frida Stalker cannot take a thread through fork() (the child dies at once), so
   the host's before-fork callback writes a GAP record and unfollows the thread, fork()
   runs natively, and afterwards the parent follows the thread again while the child lets
   go of every ring.  No JavaScript may run in a forked child (the agent's lock may be
   held by a thread the child does not have), so these hooks are C and only call the host
   back in the traced process itself: for every fork(), so that the host also knows which
   threads it must not start following (stalker_agent.js). */
extern void bt_before_fork(void);
extern void bt_after_fork(void);
void bt_release_faults(void);
static int read_safely(const void *addr, void *out, uint64_t n);

/* System calls made inline: a thread followed again must not be seen calling into libc
   (bt_on_fork_done). */
static long raw_syscall3(long number, long a, long b, long c) {
  long result;
  __asm__ __volatile__("syscall"
                       : "=a"(result)
                       : "a"(number), "D"(a), "S"(b), "d"(c)
                       : "rcx", "r11", "memory");
  return result;
}

/* Returns what the word held: `desired` went in if that is `expected`. */
static int swap_int(int *word, int expected, int desired) {
  int before;
  __asm__ __volatile__("lock cmpxchgl %2, (%1)"
                       : "=a"(before)
                       : "r"(word), "r"(desired), "a"(expected)
                       : "memory", "cc");
  return before;
}

/* Under child gating (--follow-fork) Frida's own fork() hook handles one fork() at a time
   and no more: it stops and restarts the agent's one thread, and keeps the fork()'s ids
   with the host in single fields.  Two threads forking at once killed the program in
   Frida's code (abort() on "Invalid ID" from the host, or SIGSEGV), plain Frida as well
   (docs/fork.md section 15).  So from the moment Frida's hook is in (bt_fork_turns) a
   fork() waits at its entry, ahead of Frida's listener, until no other is between that
   entry and the end of Frida's recovery (bt_on_fork_done).  A turn whose thread is gone
   is taken over; one left held because this script was unloaded while its thread was
   inside fork() (its bt_on_fork_done never runs) ends with bt_fork_turns(0), which the
   script's dispose() calls, and the threads waiting go on: Frida's hook is gone by then. */
static void take_fork_turn(void) {
  if (!g_atomic_int_add(&STATE->fork_turns, 0))
    return; /* without --follow-fork: no system call on the way into fork() */
  int me = (int)raw_syscall3(186 /* gettid */, 0, 0, 0), owner;
  while (g_atomic_int_add(&STATE->fork_turns, 0) &&
         (owner = swap_int(&STATE->fork_turn, 0, me)) != 0 && owner != me) {
    if (raw_syscall3(234 /* tgkill */, STATE->pid, owner, 0) == -3 /* ESRCH */)
      swap_int(&STATE->fork_turn, owner, 0);
    else
      bt_futex_wait((uint32_t *)&STATE->fork_turn, owner, 1000000);
  }
}

static void wake_turn_waiters(void) {
  raw_syscall3(202 /* futex */, (long)&STATE->fork_turn, 1 /* FUTEX_WAKE */, 0x7fffffff);
}

static void give_fork_turn(void) {
  if (!g_atomic_int_add(&STATE->fork_turn, 0))
    return; /* nobody's turn: not a thread of ours to ask its id */
  int me = (int)raw_syscall3(186 /* gettid */, 0, 0, 0);
  if (swap_int(&STATE->fork_turn, me, 0) == me)
    wake_turn_waiters();
}

void bt_give_fork_turn(void) {
  give_fork_turn();
}

/* bt_fork_turns(on): in a forked child's script, only fork()s that come through the fork
   stub take turns (bt_fork_first) */
#define BT_TURNS_AHEAD_ONLY 2

void bt_fork_turns(int on) {
  g_atomic_int_add(&STATE->fork_turns, on - g_atomic_int_add(&STATE->fork_turns, 0));
  if (!on) {
    g_atomic_int_add(&STATE->fork_turn, -g_atomic_int_add(&STATE->fork_turn, 0));
    wake_turn_waiters();
    g_atomic_int_add(&STATE->forks_pending, -g_atomic_int_add(&STATE->forks_pending, 0));
    bt_futex_wake((uint32_t *)&STATE->forks_pending);
  }
}

/* A new thread runs Gum's code before the thread observer's onAdded, where it takes its
   fork turn: the thread registry's listener at its start, which takes the registry's lock
   (docs/fork.md section 18: a child inherited a recursive mutex held by a thread starting
   in the parent).  So a thread the program starts is counted from its pthread_create()
   until its onAdded has the turn (bt_thread_turn), and a fork() waits, its turn given back,
   until none is counted; meanwhile new pthread_create()s wait for it.  Both sides count
   the same threads: started by the program's code (not Frida's, nor its injector's, which
   calls pthread_create() from code in no module around a fork() and must never wait) at a
   routine of the program's.  Each side announces itself with a locked add before it reads
   the other's word, so one of them sees the other. */
static int is_programs(uint64_t address) {
  const BtCodeRange *range = code_range(address);
  return range != NULL && !range->fridas;
}

/* Takes one off a count that is above 0, and wakes its waiters as it reaches 0. */
static void take_one(int *count) {
  int n = g_atomic_int_add(count, 0);
  while (n > 0 && swap_int(count, n, n - 1) != n)
    n = g_atomic_int_add(count, 0);
  if (n == 1)
    bt_futex_wake((uint32_t *)count);
}

static void thread_start_done(void) {
  take_one(&STATE->threads_starting);
}

void bt_init_thread_starts(uint64_t tls_dtors) {
  STATE->threads_starting = 0;
  STATE->forks_pending = 0;
  STATE->starts_in_fork = 0;
  STATE->tls_dtors = tls_dtors;
}

void bt_on_pthread_create(GumInvocationContext *ic) {
  int *counted = GUM_IC_GET_INVOCATION_DATA(ic, int);
  *counted = 0;
  if (!g_atomic_int_add(&STATE->fork_turns, 0) || in_forked_child()
      || !is_programs((uint64_t)gum_invocation_context_get_return_address(ic))
      || !is_programs((uint64_t)gum_invocation_context_get_nth_argument(ic, 2)))
    return;
  if (g_atomic_int_add(&STATE->fork_turn, 0) == (int)raw_syscall3(186 /* gettid */, 0, 0, 0)) {
    /* a fork()'s own thread, in an atfork handler: the thread it starts is up before that
       fork() is done, so it can neither wait for the fork() nor have its ring (the host's
       answer comes once Frida is done with the fork()): it goes untraced (bt_thread_turn) */
    g_atomic_int_add(&STATE->starts_in_fork, 1);
    *counted = 2;
    return;
  }
  int pending;
  while (g_atomic_int_add(&STATE->threads_starting, 1),
         (pending = g_atomic_int_add(&STATE->forks_pending, 0)) != 0) {
    thread_start_done();
    while ((pending = g_atomic_int_add(&STATE->forks_pending, 0)) != 0)
      bt_futex_wait((uint32_t *)&STATE->forks_pending, (uint32_t)pending, 1000000);
  }
  *counted = 1;
}

void bt_on_pthread_create_leave(GumInvocationContext *ic) {
  int counted = *GUM_IC_GET_INVOCATION_DATA(ic, int);
  if (counted == 0 || gum_invocation_context_get_return_value(ic) == 0)
    return;
  if (counted == 1)
    thread_start_done(); /* no thread started */
  else
    take_one(&STATE->starts_in_fork);
}

/* With the fork turn taken: 2 s at most, should a count never come down (a thread whose
   onAdded never ran). */
static void wait_for_thread_starts(void) {
  g_atomic_int_add(&STATE->forks_pending, 1);
  int n;
  for (int waited = 0; (n = g_atomic_int_add(&STATE->threads_starting, 0)) > 0 && waited < 2000;
       waited++) {
    give_fork_turn(); /* the starting thread takes it in its onAdded */
    bt_futex_wait((uint32_t *)&STATE->threads_starting, (uint32_t)n, 1000000);
    take_fork_turn();
  }
}

/* A thread of the program that runs this script's JavaScript as it starts (the thread
   observer) or ends (bt_on_tls_dtors) holds the fork turn throughout, taken before it
   waits for the script's lock: a fork() meanwhile left its child that lock (a recursive
   mutex) held by a thread the child does not have, and Frida's recovery in the child
   waited on it for good, its parent in waitpid() (docs/fork.md section 18).  Not a thread
   started at code in no module or in Frida's: Frida's injector starts one around a fork()
   (with child gating), and that fork()'s recovery waits for it.  Returns 1 if it took the
   turn (give it back with bt_give_fork_turn), 2 for a thread that a fork()'s own thread
   started inside that fork() (bt_on_pthread_create), which is not to be traced, else 0. */
int bt_thread_turn(uint64_t routine) {
  if (!g_atomic_int_add(&STATE->fork_turns, 0) || in_forked_child())
    return 0;
  if (routine != 0 && !is_programs(routine))
    return 0;
  int me = (int)raw_syscall3(186 /* gettid */, 0, 0, 0);
  if (g_atomic_int_add(&STATE->fork_turn, 0) == me)
    return 0;
  if (routine != 0 && g_atomic_int_add(&STATE->starts_in_fork, 0) > 0) {
    take_one(&STATE->starts_in_fork);
    return 2;
  }
  take_fork_turn();
  if (routine != 0)
    thread_start_done(); /* counted by bt_on_pthread_create */
  return 1;
}

/* Past the hold (bt_hold_forks). */
static void enter_fork_untaken(void) {
  /* both sides announce themselves with a locked add before they look at the other's word
     (g_atomic_int_add: a full barrier), so either the holder sees this fork in flight or
     this fork sees the hold */
  while (g_atomic_int_add(&STATE->forks_in_flight, 1), g_atomic_int_add(&STATE->forks_held, 0)) {
    g_atomic_int_add(&STATE->forks_in_flight, -1);
    while (g_atomic_int_add(&STATE->forks_held, 0))
      bt_futex_wait((uint32_t *)&STATE->forks_held, 1, 1000000);
  }
}

/* The way into a fork(): past the hold, then the turn. */
static void enter_fork(void) {
  enter_fork_untaken();
  take_fork_turn();
  if (g_atomic_int_add(&STATE->fork_turns, 0))
    wait_for_thread_starts();
}

int bt_fork_mark(void);
static int declines_stub(void);

/* In a forked child this script was loaded after Frida's fork() hook was in, so its entry
   listener runs after Frida's preparation for the fork(), too late for the turn: two of the
   child's threads forking at once died in Frida's code as the parent's did (docs/fork.md
   section 20).  The child's fork() calls through its GOT go through its copy of the
   parent's fork stub, which calls this first, ahead of Frida's hook (the mark's slot,
   forkDoneLast in stalker_agent.js).  Its other fork()s (through a pointer) take no turn
   (BT_TURNS_AHEAD_ONLY): one taken after Frida's preparation could wait for a fork() that
   waits in Frida's preparation for this one.  Returns as bt_fork_mark does. */
int bt_fork_first(void) {
  BtThread *t = current_thread();
  if (t == NULL || in_forked_child())
    return 1; /* the entry listener takes the turn */
  settle_held_signal(t);
  if (g_atomic_int_add(&STATE->fork_turns, 0)) {
    enter_fork();
    t->fork_entered = 1;
  }
  if (declines_stub())
    return 0;
  t->fork_kept = 1; /* as bt_fork_mark: the script left the stub's `inner` out too */
  t->fork_native = 1;
  return 1;
}

void bt_on_fork_enter(GumInvocationContext *ic) {
  /* for the child's leave listener (drop_inherited_contexts), in a forked child's copy
     of this script as well: its own children inherit its contexts */
  *GUM_IC_GET_INVOCATION_DATA(ic, uint32_t) = (uint32_t)raw_syscall3(186 /* gettid */, 0, 0, 0);
  if (in_forked_child())
    return;
  BtThread *t = current_thread();
  if (t != NULL && t->fork_entered)
    t->fork_entered = 0;
  else if (g_atomic_int_add(&STATE->fork_turns, 0) == BT_TURNS_AHEAD_ONLY)
    enter_fork_untaken();
  else
    enter_fork();
  bt_before_fork();
}

static int *stalker_mutex(void);
static int take_lock(int *lock);
static void release_glib_mutex(int *mutex, int in_child);

/* A forked child inherits Stalker's contexts of the parent's threads, and Frida's flush of
   this script there has Gum free every context whose thread the process does not have --
   all but the forking thread's.  A thread of the parent that was compiling code as another
   forked left its context half changed in the child's copy (Gum's hash table of its blocks
   grown, the old table not yet let go of): freeing it there corrupted Frida's heap.  A
   stuck child's JavaScript thread had faulted inside dlmalloc, freeing under the script's
   flush (a free chunk whose size and links read 0), and spun for good in Frida's fault
   handler on the heap lock it held itself; others died of that SIGSEGV (docs/fork.md
   section 23).  Frida's flush also waited on those contexts' GObject locks held by the
   parent's threads (section 22), and Gum's stop reached for their threads by id, through
   a helper that ptraces -- in the child, ids of the PARENT's threads: the parent died in
   Frida's recovery (section 16).
   So the child takes every context but the forking thread's out of Stalker's list: Gum
   never sees them, and the child keeps their memory, a copy of its parent's, untouched.
   The forking thread's own is left in: the thread runs on in it in the child until
   Frida's flush (taking it out sent the child's thread out from under Stalker; section
   16's table).  Gum 17's private layout (GumStalker.contexts, a GSList, at +0xb0, under
   its mutex; GumExecCtx.stalker at 16, .thread_id at 24): used only once
   widen_inline_cache() has checked the object, and only when every context in the list
   reads back as this Stalker's. */
static uint8_t **inherited_contexts(const uint8_t *stalker, int *whole) {
  uint8_t **first = NULL, **node;
  int n = 0;
  *whole = read_safely(stalker + 0xb0, &first, 8);
  for (node = first; *whole && node != NULL; node = (uint8_t **)node[1]) {
    uint8_t *entry[2], *owner;
    *whole = ++n <= 65536 && read_safely(node, entry, 16) && entry[0] != NULL
             && read_safely(entry[0] + 16, &owner, 8) && owner == stalker;
  }
  return first;
}

static void drop_inherited_contexts(uint32_t forking_thread) {
  uint8_t *stalker = STATE->stalker, **node;
  int whole = 0;
  if (stalker == NULL)
    return;
  /* read back before the mutex is touched: in a child's child, this listener comes after
     Frida's (docs/fork.md section 20), whose flush may have freed the object */
  inherited_contexts(stalker, &whole);
  if (!whole || !take_lock(stalker_mutex()))
    return;
  uint8_t ***link = (uint8_t ***)(stalker + 0xb0);
  for (node = inherited_contexts(stalker, &whole); whole && node != NULL;
       node = (uint8_t **)node[1])
    if (*(uint64_t *)(node[0] + 24) != forking_thread)
      *link = (uint8_t **)node[1];
    else
      link = (uint8_t ***)&node[1];
  release_glib_mutex(stalker_mutex(), 0);
}

/* The child's side; the parent's thread is followed again in bt_on_fork_done. */
void bt_gum_reader_restore(void);

void bt_on_fork_leave(GumInvocationContext *ic) {
  if ((gssize)gum_invocation_context_get_return_value(ic) != 0)
    return;
  /* the child's fork() calls go on through its copy of the fork stub, which must not call
     into this module: Frida may unload the child's copy of it.  Only if the mark is still
     ours: in a forked child's script this listener comes after Frida's, which holds the
     new child while the host loads its own script, which points the mark at its own
     bt_fork_first (docs/fork.md section 20) */
  uint64_t *mark = STATE->fork_mark_slot;
  if (mark != NULL && (*mark == (uint64_t)bt_fork_mark || *mark == (uint64_t)bt_fork_first))
    *mark = STATE->fork_noop;
  for (int i = 0; i < STATE->nthreads; i++)
    if (STATE->threads[i] != NULL)
      bt_thread_forget(STATE->threads[i]);
  bt_release_faults(); /* Frida frees this code in the child */
  bt_gum_reader_restore(); /* (so may Frida this module) */
  disarm_inherited_altstack();
  leave_parents_trace(STATE->unhook_children);
  drop_inherited_contexts(*GUM_IC_GET_INVOCATION_DATA(ic, uint32_t));
  if (STATE->unhook_children)
    restore_program_fault_handlers();
}

/* The end of a fork() for the host's count (forks_in_flight), in a listener of its own
   that runs after Frida's: Gum calls the listeners of a function in the order they were
   attached, at its return as at its entry, and Frida's fork() hook (child gating), added
   after ours, recovers from the fork() in its leave listener -- a round trip to the host
   that restarts the agent's thread.  A message to the agent in the middle of that recovery
   breaks it (the program hangs, then dies in Frida's code), so the host must count a fork()
   as under way until Frida is done with it: stalker_agent.js moves this listener behind
   Frida's (forkDoneLast).  A thread let go of for the fork() is followed again only at its
   end (below); one that stayed followed (the fork stub) runs it natively, in a call Stalker
   leaves out.  In the traced process every fork() was counted at its entry, so the
   count is above 0 here; what a forked child does to its copy of it does not matter.  The
   next fork() may go to Frida's hook from here (take_fork_turn). */
void bt_on_fork_done(GumInvocationContext *ic) {
  if ((gssize)gum_invocation_context_get_return_value(ic) == 0)
    return;
  /* a fork() that took the turn counted itself pending (wait_for_thread_starts) */
  if (g_atomic_int_add(&STATE->fork_turn, 0) == (int)raw_syscall3(186 /* gettid */, 0, 0, 0)) {
    give_fork_turn();
    take_one(&STATE->forks_pending);
  }
  if (g_atomic_int_add(&STATE->forks_in_flight, 0) > 0)
    g_atomic_int_add(&STATE->forks_in_flight, -1);
  /* a thread let go of for the fork() (bt_before_fork) is followed again only here, at the
     end: followed again in bt_on_fork_leave, it ran this listener followed, whose futex
     wake (take_one: syscall()) read as the program's call after each fork(), with or
     without --follow-fork.  Not followed now, it may call into a library
     (in_forked_child()). */
  if (!in_forked_child())
    bt_after_fork();
}

/* A thread that was inside a fork() begun before the fork hook was in place is followed
   where that fork() returns to its caller (a probe on the return address): in the traced
   process only, never in the child, where no JavaScript may run.  One that comes out while
   the host gets ready to follow the threads waits here until it has (bt_fork_returned
   says so), then is followed from here: nothing it did after fork() goes untraced. */
extern int bt_fork_returned(void);

void bt_on_fork_return(GumInvocationContext *ic) {
  if (in_forked_child() || !bt_fork_returned())
    return;
  while (g_atomic_int_add(&STATE->returns_held, 0))
    bt_futex_wait((uint32_t *)&STATE->returns_held, 1, 1000000);
  bt_fork_returned();
}

void bt_hold_returns(int hold) {
  g_atomic_int_add(&STATE->returns_held, (hold ? 1 : 0) - g_atomic_int_add(&STATE->returns_held, 0));
  if (!hold)
    bt_futex_wake((uint32_t *)&STATE->returns_held);
}

/* The host holds new forks while it follows the threads of a process it attached to (a
   thread followed from outside on its way into fork() is taken through it by Stalker, and
   its child dies), and, with --follow-fork, while Frida adds its own fork() hook (child
   gating) and while it removes it.  A thread inside a hooked fork() as that hook is added
   gets Frida's recovery from fork() without Frida's preparation for it -- Gum calls the
   listeners there at the entry on the way in and those there at the exit on the way out --
   and the process or its child dies in Frida's code; as it is removed, the preparation
   without the recovery, and the process hangs, then dies.  So then no fork() may be under
   way or held inside fork(): calls through
   the program's GOT wait at a gate in front of fork() instead (bt_fork_gate, put in the GOT
   by stalker_agent.js).  hold: 0 lets every fork go; 1 gates them and holds them at fork()'s
   entry too; 2 only gates them; 3 gates them and leaves those the host holds at fork()'s
   entry held (it holds them so itself, writing forks_held, at the end: _ForkCounters in
   stalker.py).  Returns how many are still past the gate or inside fork() (the host waits
   for 0). */
int bt_hold_forks(int hold) {
  if (hold == 0 || hold == 2) {
    g_atomic_int_add(&STATE->forks_held, -STATE->forks_held);
    bt_futex_wake((uint32_t *)&STATE->forks_held);
  }
  if (!hold) {
    g_atomic_int_add(&STATE->forks_gated, -STATE->forks_gated);
    bt_futex_wake((uint32_t *)&STATE->forks_gated);
    return 0;
  }
  if (!g_atomic_int_add(&STATE->forks_gated, 0))
    g_atomic_int_add(&STATE->forks_gated, 1);
  if (hold == 1 && !g_atomic_int_add(&STATE->forks_held, 0))
    g_atomic_int_add(&STATE->forks_held, 1);
  return g_atomic_int_add(&STATE->forks_in_flight, 0) + g_atomic_int_add(&STATE->forks_passing, 0);
}

/* The end of a recording (letGoOfAll in stalker_agent.js) lets go of every thread through
   Gum, which looks a thread's GumExecCtx up once and goes on using it, unlocked, while it
   stops the thread and retries (gum_stalker_invalidate_for_thread, gum_stalker_unfollow).
   A thread that unfollows itself on its way into fork() meanwhile (bt_before_fork) frees
   that context at once, and Gum then wrote into freed memory: attached to a shell forking
   subshells, 2 recordings of 60 killed it with SIGSEGV in a thread of Frida's.  So
   fork() waits at its entry meanwhile, unless the host holds it there already (its hold
   stays as it is).  hold 1: takes the hold if none is, and returns how many fork()s are
   still past their entry (-1: the host holds them, and its hold is left as it was); 0: lets
   go of the hold taken. */
int bt_hold_forks_at_entry(int hold) {
  if (!hold) {
    g_atomic_int_add(&STATE->forks_held, -1);
    bt_futex_wake((uint32_t *)&STATE->forks_held);
    return 0;
  }
  /* a locked add, as bt_on_fork_enter needs (a full barrier); it returns the count before */
  if (g_atomic_int_add(&STATE->forks_held, 1) != 0) {
    g_atomic_int_add(&STATE->forks_held, -1);
    return -1;
  }
  return g_atomic_int_add(&STATE->forks_in_flight, 0);
}

int bt_forks_in_flight(void) {
  return g_atomic_int_add(&STATE->forks_in_flight, 0);
}

extern int fork(void);

/* The program's calls of fork() through its GOT go through the fork stub (forkStub in
   stalker_agent.js), which runs fork() natively as a call Stalker leaves out, so that the
   thread comes back to the code Stalker compiled for it before.  The stub marks the thread
   first, for the fork() hook (bt_before_fork): it writes the GAP but does not unfollow it.
   Returns 0 where the stub is to call fork() followed instead, the hook's way (unfollowed
   there, followed again after it): the main thread under --follow-fork (declines_stub). */
int bt_fork_mark(void) {
  if (in_forked_child())
    return 1;
  BtThread *t = current_thread();
  settle_held_signal(t);
  if (declines_stub())
    return 0;
  if (t != NULL)
    t->fork_kept = t->fork_native = 1;
  return 1;
}

/* Under child gating Frida's injector re-creates the agent's thread after each fork() on
   the process's main thread, stopped wherever it is: in the parent, inside Frida's own
   recovery from that fork() when the main thread forked.  Frida's heap was then found
   corrupt (dlmalloc's free() faulting, docs/fork.md section 28) in 17 of 22 recordings of
   forkloop's 200 forks when that thread had come through the stub, followed in a call
   Stalker leaves out, and in 13 of 28 with it unfollowed for each fork() (section 30).
   Other threads keep the stub (section 20). */
static int declines_stub(void) {
  return !STATE->unhook_children /* set from --follow-fork, as children are followed */
         && (uint32_t)raw_syscall3(186 /* gettid */, 0, 0, 0) == STATE->pid;
}

/* The word of Frida's loader's table of libc functions that holds pthread_create()
   (stalker_agent.js: injectorGuarded), in the loader's mapping `words` (`size` bytes): the
   context is the word at `libc_at` that points to a table inside the mapping whose word at
   `slot_at` holds `created` or, in a forked child, the stub its parent put there (which
   starts with the 8 bytes `guard_head` and keeps `created` a page on).  In C: the same scan
   in JavaScript took long enough, in each vfork()ed child's agent, for the child to die in
   Frida's code (Python's subprocess.run(), 3 runs of 3).  Returns the word, or NULL. */
uint64_t *bt_find_loader_slot(uint64_t *words, uint64_t size, uint64_t libc_at, uint64_t slot_at,
                              uint64_t created, uint64_t guard_head) {
  uint64_t start = (uint64_t)words, end = start + size;
  for (uint64_t at = 0; at + libc_at + 8 <= size; at += 8) {
    uint64_t table = words[(at + libc_at) / 8];
    if (table < start || table + slot_at + 8 > end || (table & 7) != 0)
      continue;
    uint64_t *slot = (uint64_t *)(table + slot_at), head = 0, real = 0;
    if (*slot == created)
      return slot;
    if (read_safely((void *)*slot, &head, 8) && head == guard_head
        && read_safely((void *)(*slot + 4096), &real, 8) && real == created)
      return slot;
  }
  return NULL;
}

/* Frida's heap is dlmalloc with two mspaces, whose pointers are among the agent's static
   data, as its malloc_params are: found by their values (the magic word, a 4 KiB page, a
   64 KiB granularity, a 256 KiB mmap threshold, a 2 MiB trim threshold, default flags 7),
   then each mspace (16 bytes into a page: the first chunk of its first mapping) by that
   magic word at +64 and its flags (locks, mmap, non-contiguous: 7) at +880; its spin lock
   is the int after them.  `words`: the agent's .data and .bss, `size` bytes.  None is
   taken unless exactly two read back so.  Returns how many were found. */
int bt_find_heap_locks(const uint64_t *words, uint64_t size) {
  uint64_t n_words = size / 8, magic = 0;
  for (uint64_t i = 0; i + 5 < n_words && magic == 0; i++)
    if (words[i + 1] == 4096 && words[i + 2] == 65536 && words[i + 3] == 262144
        && words[i + 4] == 2097152 && words[i + 5] == 7 && (words[i] & 15) == 8)
      magic = words[i];
  if (magic == 0)
    return 0;
  int *found[3];
  int n = 0;
  for (uint64_t i = 0; i < n_words && n < 3; i++) {
    uint64_t m = words[i], m_magic = 0;
    uint32_t flags_and_lock[2];
    if ((m & 0xfff) != 0x10 || m < 0x10000 || m >= 0x800000000000ULL
        || !read_safely((void *)(m + 64), &m_magic, 8) || m_magic != magic
        || !read_safely((void *)(m + 880), flags_and_lock, 8) || flags_and_lock[0] != 7
        || flags_and_lock[1] > 1)
      continue;
    int *lock = (int *)(m + 884), seen = 0;
    for (int j = 0; j < n; j++)
      seen |= found[j] == lock;
    if (!seen)
      found[n++] = lock;
  }
  if (n != 2)
    return 0;
  STATE->heap_locks[0] = found[0];
  STATE->heap_locks[1] = found[1];
  return 2;
}

/* Two of GLib's mutexes (futex words: 0 free, 1 held, 2 held with waiters asleep on
   FUTEX_WAIT_PRIVATE) that the program's threads take inside Frida's code outside any fork
   turn, and that Frida's recovery in a forked child takes: a child forked while a thread
   held one inherited it held by a thread it does not have, and waited for good
   (docs/fork.md section 22).
   - GLib's signal lock (gsignal.c's g_signal_mutex), which each g_signal_emit() takes: Gum's
     thread registry emits "thread-added" on every new thread and "thread-removed" on every
     ending one, in that thread, around onAdded's fork turn.  The forking child's recovery
     (GDBus, GObject) waited on it.
   - Stalker's mutex (GumStalker.mutex, the word before its list of contexts: +0xa8, see
     drop_inherited_contexts), which a thread takes as it starts being followed -- GumJS
     calls gum_stalker_follow_me() for Stalker.follow() once the script's lock is let go,
     after onAdded has given its turn back -- and as it ends; Frida's flush of this script in
     the child (gum_stalker_stop()) takes it.
   Neither holder takes the other inside, both take Frida's heap lock inside, so a fork()
   takes them before those. */
#define FORK_HELD_SIGNAL 1
#define FORK_HELD_STALKER 2

static int *stalker_mutex(void) {
  return STATE->stalker == NULL ? NULL : (int *)(STATE->stalker + 0xa8);
}

/* A thread that waits on a GLib mutex while a fork() holds it is woken as g_mutex_unlock()
   would wake it -- but by both kinds of wake: Frida's GLib waits with FUTEX_WAIT (the
   shared kind, op 0, as /proc/PID/syscall shows), and the kernel keys a shared futex apart
   from a private one, so the FUTEX_WAKE_PRIVATE this sent before woke no one.  Frida's
   thread waiting on GLib's signal lock slept for good after the fork() let go of it (the
   lock read 0), every message of the agent's with it: the next thread that started waited
   for good for its ring, and the program with it (`fork starts 20` hung 10 of 10). */
static void release_glib_mutex(int *mutex, int in_child) {
  if (in_child) {
    *(volatile int *)mutex = 0; /* the child has no other thread to wake */
    return;
  }
  int before;
  __asm__ __volatile__("xchgl %0, (%1)" : "=r"(before) : "r"(mutex), "0"(0) : "memory");
  if (before == 2) {
    raw_syscall3(202 /* futex */, (long)mutex, 1 /* FUTEX_WAKE */, 1);
    raw_syscall3(202, (long)mutex, 1 | 128 /* FUTEX_WAKE_PRIVATE */, 1);
  }
}

static void release_glib_locks(int held, int in_child) {
  if (held & FORK_HELD_STALKER)
    release_glib_mutex(stalker_mutex(), in_child);
  if (held & FORK_HELD_SIGNAL)
    release_glib_mutex(STATE->signal_lock, in_child);
}

/* GLib's signal lock is a static of the agent, unnamed (stripped): found as the static GMutex
   that g_mutex_lock() is called on (lea rdi, [rip+X]; call g_mutex_lock) from at least 4
   places within 64 KiB of the code that names "-gtk-private-changed", a string of
   gsignal.c's own (its address `marker`, found by the script), and from nowhere else there;
   X must lie in the agent's static data.  `text`: the agent's code.  Returns X, or NULL. */
void *bt_find_signal_lock(const uint8_t *text, uint64_t text_size, const uint8_t *marker,
                        const uint8_t *data, uint64_t data_size) {
  const uint8_t *end = text + text_size, *first = NULL, *last = NULL;
  /* lea r64, [rip+marker]: 48|4c 8d modrm disp32, looked for from its 0x8d eight bytes at a
     time (a byte loop compiled by TinyCC took 60-90 ms per process) */
  const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
  for (const uint8_t *word = text + 1; word + 8 + 6 <= end; word += 8) {
    uint64_t x = *(const uint64_t *)word ^ (0x8d * ones);
    if (((x - ones) & ~x & highs) == 0)
      continue; /* no 0x8d among these eight */
    for (const uint8_t *op = word; op < word + 8; op++) {
      const uint8_t *p = op - 1;
      if (op[0] == 0x8d && (p[0] == 0x48 || p[0] == 0x4c) && (p[2] & 0xc7) == 0x05
          && p + 7 + *(const int32_t *)(p + 3) == marker) {
        if (first == NULL)
          first = p;
        last = p;
      }
    }
  }
  if (first == NULL || last - first > 0x10000)
    return NULL;
  const uint8_t *lock_fn = (const uint8_t *)(void *)g_mutex_lock;
  const uint8_t *from = first - text > 0x10000 ? first - 0x10000 : text;
  const uint8_t *to = end - last > 0x10000 + 12 ? last + 0x10000 : end - 12;
  const uint8_t *found[8];
  int counts[8], n = 0;
  for (const uint8_t *p = from; p < to; p++) {
    if (p[0] != 0x48 || p[1] != 0x8d || p[2] != 0x3d || p[7] != 0xe8
        || p + 12 + *(const int32_t *)(p + 8) != lock_fn)
      continue;
    const uint8_t *mutex = p + 7 + *(const int32_t *)(p + 3);
    if (mutex < data || mutex + 4 > data + data_size)
      continue;
    int j = 0;
    while (j < n && found[j] != mutex)
      j++;
    if (j == n) {
      if (n == 8)
        return NULL;
      found[n] = mutex;
      counts[n++] = 0;
    }
    counts[j]++;
  }
  int best = -1;
  for (int j = 0; j < n; j++)
    if (counts[j] >= 4) {
      if (best >= 0)
        return NULL;
      best = j;
    }
  if (best < 0)
    return NULL;
  return (void *)found[best];
}

void bt_use_signal_lock(int *lock) {
  STATE->signal_lock = lock;
}

/* The first n of the two. */
static void release_heap_locks(int n) {
  while (n-- > 0)
    swap_int(STATE->heap_locks[n], 1, 0);
}

/* Two million tries at most (a yield every 64), should a lock never be let go of (a thread
   of the parent stopped for good inside dlmalloc, or holding one of GLib's): the fork()
   then goes on without them, as it did before. */
static int take_lock(int *lock) {
  for (long spins = 0; swap_int(lock, 0, 1) != 0; spins++) {
    if (spins > 2000000)
      return 0;
    if ((spins & 63) == 63)
      raw_syscall3(24 /* sched_yield */, 0, 0, 0);
  }
  return 1;
}

/* Frida's heap (dlmalloc, two mspaces, each behind a spin lock) is not taken care of across
   a fork(): a child forked while another thread of its parent was inside it -- Stalker
   compiling that thread's code, a listener -- inherited the lock held by a thread it does
   not have, and Frida's recovery in the child, its only thread, spun on it for good
   (docs/fork.md section 21).  So a fork() takes both locks right before its system call, as
   glibc does with its own malloc's, and lets go of them in the parent and in the child
   right after.  Last, in _Fork(), after glibc's own locks: a thread that holds one of
   glibc's while Stalker compiles its code waits there for Frida's heap, never the other way
   round (whoever holds Frida's heap lock is inside dlmalloc, which takes none of glibc's or
   the program's).  Only a fork() that runs natively (through the fork stub): a thread still
   in Stalker would compile the rest of fork() with the lock held by itself. */
void bt_on_fork_syscall(GumInvocationContext *ic) {
  (void)ic;
  BtThread *t = current_thread();
  if (t == NULL || !t->fork_native || STATE->heap_locks[0] == NULL)
    return;
  t->fork_native = 0;
  int held = 0, n = 0;
  if (STATE->signal_lock != NULL && take_lock(STATE->signal_lock))
    held |= FORK_HELD_SIGNAL;
  if (stalker_mutex() != NULL && take_lock(stalker_mutex()))
    held |= FORK_HELD_STALKER;
  while (n < 2 && take_lock(STATE->heap_locks[n]))
    n++;
  if (n < 2) {
    release_heap_locks(n);
    release_glib_locks(held, 0);
    return;
  }
  STATE->glib_locks_held = held;
  STATE->heap_locked_by = (int)raw_syscall3(186 /* gettid */, 0, 0, 0);
}

/* In the child, whichever thread of the parent took them: the child has no other thread
   that could be inside dlmalloc or hold GLib's locks. */
void bt_on_fork_syscall_leave(GumInvocationContext *ic) {
  if (STATE->heap_locked_by == 0)
    return;
  int in_child = (gssize)gum_invocation_context_get_return_value(ic) == 0;
  if (in_child || STATE->heap_locked_by == (int)raw_syscall3(186 /* gettid */, 0, 0, 0)) {
    int held = STATE->glib_locks_held;
    STATE->glib_locks_held = 0;
    STATE->heap_locked_by = 0;
    release_heap_locks(2);
    release_glib_locks(held, in_child);
  }
}

/* Whether the thread came through the fork stub, for the fork() hook, once. */
int bt_thread_fork_kept(BtThread *t) {
  int kept = t->fork_kept;
  t->fork_kept = 0;
  return kept;
}

int bt_fork_gate(void) {
  int passing = !in_forked_child(); /* a child runs on with its copy of a patched GOT */
  if (passing)
    while (g_atomic_int_add(&STATE->forks_passing, 1), g_atomic_int_add(&STATE->forks_gated, 0)) {
      g_atomic_int_add(&STATE->forks_passing, -1);
      while (g_atomic_int_add(&STATE->forks_gated, 0))
        bt_futex_wait((uint32_t *)&STATE->forks_gated, 1, 1000000);
    }
  int pid = fork();
  if (passing && pid != 0)
    g_atomic_int_add(&STATE->forks_passing, -1);
  return pid;
}


static void write_block_far(BtThread *t, uint64_t record);

/* A thread that ends, and exit() on behalf of the whole process, call __call_tls_dtors,
   where Frida's thread registry takes the thread for one that ends and Stalker lets go of
   it.  What runs from there is the program's all the same (thread_local and pthread key
   destructors, exit()'s atexit handlers, destructors and stdio flush) and a crash there is
   one to debug, so the thread is followed again (stalker_agent.js, followAgain) from where
   Frida's hook returns, a few bytes into the function: the function's first instruction
   is recorded as a block of its own, so that the call goes to the function itself, as
   Stalker records any call of a function Frida hooks (the decoder knows those few bytes
   ran relocated).  The ring is closed at the exit system call (on_exit_syscall).  C, so
   that no JavaScript runs there in a forked child. */
extern void bt_follow_again(void);

void bt_on_tls_dtors(GumInvocationContext *ic) {
  if (in_forked_child())
    return;
  BtThread *t = current_thread();
  if (t == NULL)
    return;
  write_block_far(t, (uint64_t)ic->function);
  int turn = t->ending_turn || bt_thread_turn(0);
  t->ending_turn = 0;
  bt_follow_again();
  if (turn)
    give_fork_turn();
}

/* Gum's thread registry takes its lock in its own listener at __call_tls_dtors, which runs
   before ours (bt_on_tls_dtors): the thread takes its fork turn in a callout before its
   call (docs/fork.md section 18). */
static void on_thread_ending(GumCpuContext *cpu_context, gpointer user_data) {
  BtThread *t = user_data;
  if (!t->ending_turn)
    t->ending_turn = bt_thread_turn(0);
}

/* What was mapped for a thread that runs no more of the code compiled for it goes, and its
   slot is free for the next thread (the 4 KiB page of its BtThread stays: the agent still
   reads its tid and state there).
   - `ended`: the thread ended, and the process lives on without it: a program that starts
     and ends many threads would otherwise keep every one of them.
   - else it is out of Stalker for good (on_chunk_end, bt_thread_let_go_asleep): a process
     that runs on after a recording keeps no mapping of the trace directory's files (a
     later recording of it was refused as "already traced", and deleting the directory did
     not free its space).  The check compiled after its chunk callout still reads `wp` in
     the ring's header page as the thread leaves: that page becomes a private copy in place
     rather than a hole. */
static void release_thread(BtThread *t, int ended) {
  if (t->reserve == NULL)
    return;
  settle_held_signal(t);
  if (ended) {
    t->wpp = t->wpc = &t->wp;
    if (t->header32 != NULL)
      munmap(t->header32, 4096);
    t->header32 = NULL;
  } else if (t->header32 != NULL) {
    uint64_t *copy = (uint64_t *)t->scratch_area, *page = (uint64_t *)t->header32;
    for (int i = 0; i < 512; i++)
      copy[i] = page[i];
    mmap(t->header32, 4096, 3 /* PROT_READ|WRITE */, 0x32 /* PRIVATE|FIXED|ANONYMOUS */, -1,
         0);
    for (int i = 0; i < 512; i++)
      page[i] = copy[i];
    t->wpc = t->wpp; /* the ring's mapping goes */
  }
  munmap(t->reserve, t->reserve_size); /* the ring and its block table */
  munmap(t->scratch_area, 2 * BT_CHUNK);
  if (ended) /* the thread itself, at its exit: no fault of its can read them any more */
    while (t->copies != NULL) {
      BtCopyChunk *prev = t->copies->prev;
      munmap(t->copies, BT_COPY_CHUNK);
      t->copies = prev;
    }
  if ((uint32_t)syscall(186 /* gettid */) == t->tid)
    disarm_altstack(t, ended);
  if (t->cs_insn != NULL)
    cs_free(t->cs_insn, 1);
  t->cs_insn = NULL;
  t->reserve = NULL;
  give_back_slot(t);
}

/* Where the thread ends, with the system call about to end it (THREAD_EXIT): its last
   block runs on past that instruction in the code (`syscall; jmp back` in start_thread),
   and none of that runs. */
static void write_end(BtThread *t, GumCpuContext *cpu) {
  if (t->closed)
    return;
  long ts[2];
  clock_gettime(1 /* CLOCK_MONOTONIC */, ts);
  uint64_t end[5] = {bt_escape(BT_RECORDTYPE_THREAD_EXIT, 4, t->tid & 0xffffffffffULL),
                     (uint64_t)(ts[0] * 1000000000L + ts[1]) & BT_PAYLOAD_MASK,
                     t->syscall_at & BT_PAYLOAD_MASK, cpu->rdi & BT_PAYLOAD_MASK,
                     cpu->rax & BT_PAYLOAD_MASK};
  enter_c(t);
  if (!t->closed) {
    sync_head(t);
    write_counted(t, end, 5);
    refill(t);
  }
  leave_c(t);
}

/* Before an execve() or execveat(): the same record, as the process's image ends there if
   the call succeeds (the ring is left as the exec finds it, read as ended at exec).  One
   that fails returns, and the thread's next blocks follow the record: readers take a
   THREAD_EXIT for the end only when nothing is recorded after it. */
static void on_exec_syscall(GumCpuContext *cpu, gpointer user_data) {
  if (!in_forked_child())
    write_end(user_data, cpu);
}

/* Before a system call instruction, when it is exit (the thread ends) or exit_group (the
   process does): see put_syscall_checks.  Nothing but the kernel runs after it, and the ring is
   closed, so that it ends like the ring of a thread that ended, its records counted as
   written.  The other threads that exit_group kills where they are leave their rings open,
   read as after a crash. */
void bt_note_off_trace(void);

static void on_exit_syscall(GumCpuContext *cpu, gpointer user_data) {
  BtThread *t = user_data;
  if (in_forked_child())
    return;
  if (cpu->rax == 231 /* exit_group */)
    bt_note_off_trace();
  write_end(t, cpu);
  close_own_ring(t);
  if (cpu->rax == 60 /* exit */)
    release_thread(t, 1);
}

/* Before a close_range() system call (see put_syscall_checks), which closes the fds from
   rdi to rsi: Frida's files (its connections with the recorder, its event fds; the host
   lists them, `spared`) and the rings' fds (the writer lock) are left open, the rest
   closed here, and the call itself closes nothing more (0 returned).  Programs close every
   fd before exec (Python's subprocess, GLib's spawn) and daemons as they start: Frida's
   hooks of exit() and (under child gating) of execve() and fork() then waited for an
   answer that could never come, and the program hung there for good (Frida 17.26); and a
   ring whose lock is gone reads as its writer's end. */
static int add_spared(int *kept, int n, int cap, int fd) {
  if (n == cap || fd < 0)
    return n;
  int i = n;
  for (; i > 0 && kept[i - 1] >= fd; i--)
    if (kept[i - 1] == fd)
      return n;
  for (int j = n; j > i; j--)
    kept[j] = kept[j - 1];
  kept[i] = fd;
  return n + 1;
}

/* Write v in decimal at out + at (no stdio here); where the text now ends. */
static int put_decimal(char *out, int at, uint32_t v) {
  char digits[12];
  int n = 0;
  do
    digits[n++] = (char)('0' + v % 10);
  while ((v /= 10) != 0);
  while (n > 0)
    out[at++] = digits[--n];
  return at;
}

/* Whether f's fd is still that file of Frida's.  Only a fd that is closed, or provably
   another file, is not: one whose fdinfo cannot be read is spared, since closing a file of
   Frida's leaves its threads spinning on it for good while the program waits on them (a
   program at its fd limit that closed all its fds hung so: the open() of the fdinfo failed,
   and its close_range() took Frida's event fds with it). */
static int still_fridas(const BtSpared *f) {
  uint64_t st[18]; /* struct stat: st_ino at 8 */
  if (syscall(5 /* fstat */, f->fd, st) != 0)
    return 0;
  if (!f->is_eventfd)
    return st[1] == f->id;
  char path[32] = "/proc/self/fdinfo/";
  path[put_decimal(path, 18, (uint32_t)f->fd)] = 0;
  int info = open(path, 02000000 /* O_CLOEXEC */);
  if (info < 0)
    return 1;
  char text[512];
  long got = syscall(0 /* read */, info, text, sizeof text - 1);
  close(info);
  if (got <= 0)
    return 1;
  text[got] = 0;
  static const char key[] = "eventfd-id:";
  for (long i = 0; i + (long)sizeof key - 1 <= got; i++) {
    int j = 0;
    while (key[j] != 0 && text[i + j] == key[j])
      j++;
    if (key[j] != 0)
      continue;
    const char *p = text + i + j;
    while (*p == ' ' || *p == '\t')
      p++;
    return parse_decimal(p) == f->id;
  }
  return 0;
}

/* The fds from `first` to `last` to leave open, in order: Frida's (still so) and the
   rings'.  Only those in the range are checked, so a close() costs a few compares unless
   it is of one of them. */
static int spared_fds(int *kept, uint32_t first, uint32_t last) {
  int n = 0;
  for (int i = 0; i < STATE->nspared; i++) {
    BtSpared *f = &STATE->spared[i];
    if (f->fd < 0 || (uint32_t)f->fd < first || (uint32_t)f->fd > last)
      continue;
    if (still_fridas(f))
      n = add_spared(kept, n, 256, f->fd);
    else
      f->fd = -1; /* Frida closed it, and the number is the program's from now on */
  }
  /* read without the slots lock, as current_thread does (a BtThread's page is never
     unmapped): a forked child running this copied code may have inherited it held */
  for (int i = 0; i < STATE->nthreads; i++) {
    BtThread *t = STATE->threads[i];
    if (t != NULL && !t->closed && (uint32_t)t->w.fd >= first && (uint32_t)t->w.fd <= last)
      n = add_spared(kept, n, 256, t->w.fd);
  }
  return n;
}

static void on_close_range(GumCpuContext *cpu, gpointer user_data) {
  uint32_t first = (uint32_t)cpu->rdi, last = (uint32_t)cpu->rsi, flags = (uint32_t)cpu->rdx;
  if (in_forked_child() || (flags & 4 /* CLOSE_RANGE_CLOEXEC */) || first > last)
    return;
  int kept[256], n = spared_fds(kept, first, last);
  int spared = 0;
  uint32_t from = first;
  for (int i = 0; i < n; i++) {
    uint32_t fd = (uint32_t)kept[i];
    if (fd < from || fd > last)
      continue;
    if (fd > from)
      syscall(436 /* close_range */, from, fd - 1, flags);
    from = fd + 1;
    spared = 1;
  }
  if (!spared)
    return;
  if (from <= last)
    syscall(436 /* close_range */, from, last, flags);
  cpu->rdi = cpu->rsi = 0xffffffffu; /* no fd: the program's call succeeds, closing nothing */
  cpu->rdx = 0;
}

/* Before a close() system call: the same for a program that closes its fds one by one (the
   fallback of Python, GLib and glibc's closefrom() without close_range()).  The call is
   made on fd -1, so it fails with EBADF, as a close of an fd it does not have would. */
static void on_close(GumCpuContext *cpu, gpointer user_data) {
  int kept[256];
  if (cpu->rdi <= 0xffffffffu && spared_fds(kept, (uint32_t)cpu->rdi, (uint32_t)cpu->rdi) > 0 &&
      !in_forked_child()) /* last: a system call */
    cpu->rdi = (uint64_t)-1;
}

/* Signal handlers: the kernel enters them natively, outside Stalker's code cache.  Most
   runs are sent on into the thread's own compiled code and traced (bt_signal_enter); each
   handler the program installs also gets an entry hook, which marks a run that went
   natively with a GAP in the interrupted thread's trace: it is never silent. */
extern int bt_new_handler(void *handler);
uint64_t bt_fault_restorer(void);

/* Frida writes a hook into the code at the end of its outermost transaction, which another
   thread may hold open: a script scope begins one before it waits for the script's lock,
   so the agent's thread, about to run JavaScript for a message, holds one while a program
   thread's callout runs the script.  A hook placed from a program thread can so be missing
   from the code as the callout returns, while it is about to be run: a handler that moved
   the pc went on untraced for good (68-110 of 400 threads, each faulting once while
   others started: skipthreads).  Such a hook is waited for, up to 2 s, until the code's
   first bytes change; one still missing then is noted for the host to warn of
   (note_late_hook). */
static void note_late_hook(const char *what);

static void await_hook(uint64_t code, const uint8_t *was, const char *what) {
  for (int round = 0;; round++) {
    uint8_t now[5];
    if (!read_safely((const void *)code, now, 5))
      return;
    int same = 1;
    for (int k = 0; k < 5; k++)
      same &= now[k] == was[k];
    if (!same)
      return;
    if (round == 20000)
      break;
    long pause[2] = {0, 100000};
    syscall(35 /* nanosleep */, pause, NULL);
  }
  note_late_hook(what);
}

static void note_handler(void *handler) {
  if ((uint64_t)handler <= 1 /* SIG_DFL or SIG_IGN */ || in_forked_child())
    return;
  uint8_t was[5], restorer_was[5];
  uint64_t restorer = bt_fault_restorer();
  int seen = read_safely(handler, was, 5);
  int restorer_seen = restorer != 0 && read_safely((const void *)restorer, restorer_was, 5);
  int turn = enter_script();
  int hooked = bt_new_handler(handler); /* 1: the handler's entry, 2: the restorer */
  leave_script(turn);
  if ((hooked & 1) && seen)
    await_hook((uint64_t)handler, was, "handler");
  if ((hooked & 2) && restorer_seen)
    await_hook(restorer, restorer_was, "restorer");
}

static void note_program_action(int sig, void *handler, uint64_t flags, uint64_t mask);

/* A call of sigaction() or signal(): what it asked, for its return (bt_after_sigaction). */
typedef struct {
  int sig;
  uint8_t *old;  /* sigaction()'s old action, or NULL */
  uint64_t prev; /* the handler behind the signal stub as the call began */
} BtSigactionCall;

static uint64_t handler_adopted(int sig);
static void adopt_handler(int sig, uint64_t expected);
extern uint8_t bt_sigstub[];

static void begin_sigaction_call(GumInvocationContext *ic, int sig, uint8_t *old) {
  BtSigactionCall *call = GUM_IC_GET_INVOCATION_DATA(ic, BtSigactionCall);
  call->sig = sig;
  call->old = old;
  call->prev = handler_adopted(sig);
}

static void on_signal(GumInvocationContext *ic, uint64_t flags) {
  begin_sigaction_call(ic, (int)(uint64_t)gum_invocation_context_get_nth_argument(ic, 0), NULL);
  void *handler = gum_invocation_context_get_nth_argument(ic, 1);
  note_handler(handler);
  note_program_action((int)(uint64_t)gum_invocation_context_get_nth_argument(ic, 0), handler,
                      flags, 0);
}

void bt_on_signal(GumInvocationContext *ic) { /* signal(sig, handler), bsd_signal() */
  on_signal(ic, 0x10000000 /* SA_RESTART */);
}

void bt_on_sysv_signal(GumInvocationContext *ic) {
  on_signal(ic, 0x80000000ULL /* SA_RESETHAND */ | 0x40000000 /* SA_NODEFER */);
}

void bt_on_sigaction(GumInvocationContext *ic) { /* sigaction(sig, act, old) */
  uint8_t *act = gum_invocation_context_get_nth_argument(ic, 1);
  begin_sigaction_call(ic, (int)(uint64_t)gum_invocation_context_get_nth_argument(ic, 0),
                       gum_invocation_context_get_nth_argument(ic, 2));
  if (act == NULL)
    return;
  note_handler(*(void **)act); /* sa_handler / sa_sigaction: the union at offset 0 */
  /* glibc's struct sigaction: the mask (the kernel's 64 bits of it) at 8, the flags at 136 */
  note_program_action((int)(uint64_t)gum_invocation_context_get_nth_argument(ic, 0),
                      *(void **)act, *(uint32_t *)(act + 136), *(uint64_t *)(act + 8));
}

/* The program asked for a signal's action: it is told its own handler, not the signal
   stub, and a handler it set goes behind the stub. */
void bt_after_sigaction(GumInvocationContext *ic) {
  BtSigactionCall *call = GUM_IC_GET_INVOCATION_DATA(ic, BtSigactionCall);
  if (call->old != NULL && call->prev != 0 && *(uint64_t *)call->old == (uint64_t)bt_sigstub)
    *(uint64_t *)call->old = call->prev;
  adopt_handler(call->sig, 0);
}

void bt_after_signal(GumInvocationContext *ic) {
  BtSigactionCall *call = GUM_IC_GET_INVOCATION_DATA(ic, BtSigactionCall);
  if (call->prev != 0 &&
      (uint64_t)gum_invocation_context_get_return_value(ic) == (uint64_t)bt_sigstub)
    gum_invocation_context_replace_return_value(ic, (gpointer)call->prev);
  adopt_handler(call->sig, 0);
}

/* A handler entered in the middle of a record sequence (a timer signal can land anywhere),
   after its read of `wp` and before its write of it, must not write into the ring then: the
   sequence would resume with the old pointer, writing over the GAP and moving `wp` back.
   finish_interrupted_record() recognises that from the interrupted registers and code and
   completes the sequence in the signal frame (like a restartable sequence), so the GAP goes
   exactly where the handler ran.  When the handler interrupted the agent's own C code that
   moves the head or `wp` (a chunk claim, which in stream mode may be waiting for the host),
   or a sequence whose chunk check has fired (`wp` at a 64 KiB boundary) on its way there,
   the GAP is left due and that C code writes it as it ends (leave_c, on_chunk_end): the
   same place, since nothing is written in between. */
static int finish_interrupted_record(BtThread *t, uint8_t *uc, int kernels);

void bt_on_handler_entry(GumInvocationContext *ic) {
  if (in_forked_child())
    return;
  uint8_t *uc = gum_invocation_context_get_nth_argument(ic, 2); /* SA_SIGINFO or not */
  BtThread *t = current_thread();
  int depth = t == NULL ? 0 : t->handlers_running;
  if (depth > 0 && depth <= BT_HANDLER_DEPTH && t->handler_copy[depth - 1] != 0 &&
      t->handler_uc[depth - 1] == (uint64_t)uc)
    return; /* entered traced, through the signal stub (bt_signal_enter) */
  /* a handler set by a system call of the program's own (or whose signal the kernel gave
     before the stub took it): the stub takes it for its next runs */
  adopt_handler((int)(uint64_t)gum_invocation_context_get_nth_argument(ic, 0),
                (uint64_t)ic->function);
  if (t == NULL || t->closed)
    return;
  t->handlers_running++;
  if (!t->in_c) {
    enter_c(t);
    if (!t->closed) /* a handler called as a function gets no ucontext: read safely */
      finish_interrupted_record(t, uc, 0);
    exit_c(t);
  }
  uint64_t pc; /* read safely: a handler called as a function gets no ucontext */
  if (t->handlers_running <= BT_HANDLER_DEPTH && uc != NULL &&
      read_safely(uc + UC_RIP, &pc, 8)) {
    t->handler_uc[t->handlers_running - 1] = (uint64_t)uc;
    t->handler_pc[t->handlers_running - 1] = pc;
    t->handler_copy[t->handlers_running - 1] = 0;
  }
  if (t->in_c || (WP(t) & (BT_CHUNK - 1)) == 0 /* the chunk is full: its callout is due */) {
    t->signal_gaps_due++;
    return;
  }
  bt_thread_gap(t, BT_GAPREASON_SIGNAL);
}

/* Signal handlers traced.  The kernel enters a handler natively, so for each signal whose
   handler the program set (not the fault signals, which on_fault() takes), the kernel is
   given the agent's signal stub instead (bt_sigstub in the script; the program's handler
   is in the stub's table), which calls bt_signal_enter.  When the thread was interrupted in
   Stalker's copy of its code exactly where one of the program's instructions begins, or in
   the record of a block at a step where the sequence can be left and taken up again (no
   state of Gum's in flight in either; the thread's saved rax and rcx are kept across the
   handler), the stub "returns" into the copy of a `ret` that Stalker
   compiled for the thread, with the handler's address on the stack: Gum's code for the
   `ret` looks the handler up in the thread's own context, and the handler runs traced, as
   a call from that point.  The handler sees the program's pc in its frame, not the copy's;
   the restorer puts the copy back (bt_on_sigreturn).  Anywhere else (Gum's or the agent's
   own code, a system call Stalker left out) the handler runs natively as before, marked by
   a GAP (bt_on_handler_entry). */
extern uint8_t bt_sigstub[];
static int fault_index(int sig);
static int is_syscall_at(uint64_t address);
#define BT_SIGSTUB_ENTER 4096      /* bt_signal_enter, 0 once the recording has ended */
#define BT_SIGSTUB_MAGIC 4104
#define BT_SIGSTUB_NATIVE_RET 4112 /* a `ret` of the stub's: to the handler, natively */
#define BT_SIGSTUB_RESTORER_SYSCALL 4120 /* (restorer_syscall) */
#define BT_SIGSTUB_SKIP 4128       /* back to the kernel, no handler run (hold_signal) */
#define BT_SIGSTUB_OFF_TRACE 4136  /* handler runs outside the trace (bt_note_off_trace) */
#define BT_SIGSTUB_HANDLERS 4160   /* the program's handler for each signal 1-64 */
#define BT_SIGSTUB_MAGIC_VALUE 0x6274736967737462ULL
#define SA_RESTORER_FLAG 0x04000000ULL

static uint64_t *stub_slot(uint64_t offset) {
  return (uint64_t *)(bt_sigstub + offset);
}

/* The program's handler behind `handler` when that is an agent's signal stub (this
   recording's, or the one a recording of a parent process left in a forked child). */
static uint64_t handler_behind(int sig, uint64_t handler) {
  uint64_t magic = 0, behind = 0;
  if ((handler & 4095) == 0 &&
      read_safely((const void *)(handler + BT_SIGSTUB_MAGIC), &magic, 8) &&
      magic == BT_SIGSTUB_MAGIC_VALUE &&
      read_safely((const void *)(handler + BT_SIGSTUB_HANDLERS + 8 * sig), &behind, 8))
    return behind;
  return handler;
}

/* Give the kernel the signal stub for `sig` in place of the program's handler, keeping its
   flags, mask and restorer.  Only with the restorer whose hook brings the thread back into
   its copy (bt_on_sigreturn): another (Go's) keeps its handler, run natively.  `expected`:
   the handler whose entry hook calls this, inside a signal handler, where the script (which
   is_frida_code() may ask) must not be waited for. */
static void adopt_handler(int sig, uint64_t expected) {
  BtSigaction now;
  if (sig < 1 || sig > 64 || fault_index(sig) >= 0 || in_forked_child() ||
      *stub_slot(BT_SIGSTUB_ENTER) == 0 || syscall(13 /* rt_sigaction */, sig, NULL, &now, 8) != 0)
    return;
  uint64_t handler = (uint64_t)now.handler, restorer = bt_fault_restorer();
  if (handler <= 1 || handler == (uint64_t)bt_sigstub || restorer == 0 ||
      (uint64_t)now.restorer != restorer || !(now.flags & SA_RESTORER_FLAG))
    return;
  if (expected != 0 ? handler != expected
                    : (handler = handler_behind(sig, handler)) <= 1 || is_frida_code(handler))
    return;
  stub_slot(BT_SIGSTUB_HANDLERS)[sig] = handler;
  now.handler = bt_sigstub;
  syscall(13, sig, &now, NULL, 8);
}

/* The restorer's system call instruction (rt_sigreturn), or 0.  Its hook runs the
   instructions before it relocated and jumps back to it: the block Stalker compiles there
   gets no record, as the restorer's hook writes the way back (bt_on_sigreturn). */
static uint64_t restorer_syscall(void) {
  uint64_t *found = stub_slot(BT_SIGSTUB_RESTORER_SYSCALL); /* (the module's data is not
                                                               writable) */
  uint64_t restorer = *found == 0 ? bt_fault_restorer() : 0;
  for (int k = 0; restorer != 0 && k < 14; k++)
    if (is_syscall_at(restorer + k)) {
      *found = restorer + k;
      break;
    }
  return *found;
}

static uint64_t handler_adopted(int sig) {
  return sig >= 1 && sig <= 64 ? stub_slot(BT_SIGSTUB_HANDLERS)[sig] : 0;
}

/* The end of the recording: the program's handlers go back into the kernel; a signal the
   stub is given meanwhile goes to the handler natively. */
void bt_restore_handlers(void) {
  if (in_forked_child())
    return;
  *stub_slot(BT_SIGSTUB_ENTER) = 0;
  for (int i = 0; i < STATE->nthreads; i++)
    if (STATE->threads[i] != NULL)
      settle_held_signal(STATE->threads[i]);
  for (int sig = 1; sig <= 64; sig++) {
    BtSigaction now;
    uint64_t handler = stub_slot(BT_SIGSTUB_HANDLERS)[sig];
    if (handler != 0 && syscall(13, sig, NULL, &now, 8) == 0 &&
        now.handler == (void *)bt_sigstub) {
      now.handler = (void *)handler;
      syscall(13, sig, &now, NULL, 8);
    }
  }
}

static void write_escape(BtThread *t, const uint64_t *words, unsigned n);

static void write_branch(BtThread *t, uint64_t kind, uint64_t from, uint64_t to) {
  uint64_t rec[3] = {bt_escape(BT_RECORDTYPE_BRANCH, 2, kind), from & BT_PAYLOAD_MASK,
                     to & BT_PAYLOAD_MASK};
  write_escape(t, rec, 3);
}

static uint64_t copied_instruction_at(const BtCopy *found, uint64_t pc, uint64_t *last,
                                      int *at_start);
static int hold_signal(BtThread *t, int sig, const uint8_t *info, const uint8_t *uc,
                       const BtCopy *found, uint8_t *under);
static const BtCopy *copy_holding(BtThread *t, uint64_t pc);

static int signal_enter(BtThread *t, int forked, long sig, void *info, uint8_t *uc,
                        uint64_t *out);

/* Two signals pending as the thread goes back to user space are delivered at once, the
   second one's frame on top of the first one's, at its handler's entry: the signal stub's
   (interrupted_frame).  The first one's frame, when `uc` is such a second one's; else
   NULL. */
static uint8_t *frame_under_stub_entry(const uint8_t *uc) {
  uint64_t rip = *(const uint64_t *)(uc + UC_RIP), rsp = *(const uint64_t *)(uc + UC_RIP - 8);
  uint64_t pretcode;
  if (rip != (uint64_t)bt_sigstub || !read_safely((const void *)rsp, &pretcode, 8) ||
      pretcode != bt_fault_restorer())
    return NULL;
  return (uint8_t *)(rsp + 8);
}

/* From the signal stub, on the handler's frame: out[0] is where the stub goes, out[1] the
   handler (the stub's `ret` takes out[0], Gum's or its own `ret` out[1]).  A signal held
   at the stub's entry, on top of this one's frame (hold_signal), goes in at this
   handler's first record when the handler runs traced; else at once, before the handler
   runs natively, as the kernel had it. */
void bt_signal_enter(long sig, void *info, uint8_t *uc, uint64_t *out) {
  /* once each: a system call each, dearer than the rest of the way in where a BPF program
     runs at every system call (this kind of VM) */
  int forked = in_forked_child();
  BtThread *t = forked ? NULL : current_thread();
  int under_held = t != NULL && t->held_for_uc != 0 && t->held_for_uc == (uint64_t)uc;
  if (under_held)
    t->held_for_uc = 0;
  if (!signal_enter(t, forked, sig, info, uc, out) && under_held)
    settle_held_signal(t);
}

/* Whether the handler runs traced.  `t`: the thread (current_thread), NULL in a forked
   child (`forked`). */
static int signal_enter(BtThread *t, int forked, long sig, void *info, uint8_t *uc,
                        uint64_t *out) {
  uint64_t handler = sig >= 1 && sig <= 64 ? stub_slot(BT_SIGSTUB_HANDLERS)[sig] : 0;
  out[0] = *stub_slot(BT_SIGSTUB_NATIVE_RET);
  out[1] = handler;
  if (forked || handler == 0)
    return 0;
  if (t == NULL) { /* one of Frida's threads, or one of the program's not traced */
    /* not glibc's own: setuid() and the like send SIGSETXID to every thread glibc knows,
       Frida's too, each of which must change its credentials (SIGCANCEL goes to the
       thread cancelled only) */
    if (sig != 32 && sig != 33)
      g_atomic_int_add((int *)stub_slot(BT_SIGSTUB_OFF_TRACE), 1);
    return 0;
  }
  if (t->closed || t->in_c || t->leaving || t->handlers_running >= BT_HANDLER_DEPTH ||
      g_atomic_int_add(&STATE->renewals_held, 0))
    return 0;
  if (t->held_sig == sig) { /* delivered once for both, as a standard signal already
                               pending is */
    BT_HDR64(&t->w, BT_OFF_COUNTED_SIGNALS_MERGED) =
        BT_HDR64(&t->w, BT_OFF_COUNTED_SIGNALS_MERGED) + 1;
    out[1] = *stub_slot(BT_SIGSTUB_SKIP);
    return 0;
  }
  enter_c(t);
  if (!t->closed) /* `uc`: the kernel's frame */
    finish_interrupted_record(t, uc, 1);
  exit_c(t);
  uint64_t *rip = (uint64_t *)(uc + UC_RIP);
  uint8_t *under = frame_under_stub_entry(uc);
  if (under != NULL && hold_signal(t, (int)sig, info, uc, NULL, under)) {
    out[1] = *stub_slot(BT_SIGSTUB_SKIP);
    return 0;
  }
  uint64_t last = 0;
  int at_start = 0;
  const BtCopy *found = copy_holding(t, *rip); /* (a scan: once) */
  uint64_t from = copied_instruction_at(found, *rip, &last, &at_start);
  if (from == 0 && hold_signal(t, (int)sig, info, uc, found, NULL)) {
    out[1] = *stub_slot(BT_SIGSTUB_SKIP);
    return 0;
  }
  if (from == 0 || (!at_start && last == 0) || t->ret_copy == 0 ||
      t->ret_copy_ctx != t->exec_ctx || t->exec_ctx == NULL ||
      (WP(t) & (BT_CHUNK - 1)) == 0 /* the chunk is full: its callout is due */)
    return 0; /* natively, marked by a GAP */
  write_branch(t, BT_KIND_INTERRUPT | (at_start ? BT_INTERRUPT_AT_START : BT_INTERRUPT_INSIDE),
               from, handler);
  int depth = t->handlers_running;
  t->handler_uc[depth] = (uint64_t)uc;
  t->handler_pc[depth] = from;
  t->handler_copy[depth] = *rip;
  t->handler_last[depth] = at_start ? 0 : last;
  t->handler_ctx[depth] = t->exec_ctx;
  t->handler_saved[depth][0] = t->saved_rax;
  t->handler_saved[depth][1] = t->saved_rcx;
  t->handlers_running = depth + 1;
  *rip = from; /* what the handler sees (Go's runtime reads it) */
  out[0] = t->ret_copy;
  return 1;
}

/* Signals that come in the code Gum wrote for a block's last instruction (its branch: an
   inline cache, a lookup's prolog; about two thirds of those a timer sent that were not
   traced) cannot be followed into their handler there: Gum's state is in flight.  But no
   instruction of the program runs between there and the next block's record, so the
   signal is held until that record, where it is delivered as if it had come there: the
   stub goes back to the kernel without running the handler (BT_SIGSTUB_SKIP), the signal
   kept with its siginfo, and the page of the header the inline code reads `wp` from made
   inaccessible.  The record's first instruction then faults (let_go_held, from on_fault),
   which queues the signal again (rt_tgsigqueueinfo), blocked until that fault's handler
   returns: the kernel delivers it right there, at a step of the record where the handler
   can be followed (bt_signal_enter).  Only standard signals (one of each is ever pending,
   so queueing one again cannot fail), with on_fault in place for SIGSEGV and SIGSEGV not
   blocked, with the stub still the kernel's handler (not reset by SA_RESETHAND), and room
   in the block table (a block compiled past it has no inline record).  The way from there
   to the next record runs only Gum's code and, through the fork stub, the agent's, which
   gives the signal back at once (settle_held_signal); so does the end of the recording.
   Not in a thread leaving Stalker, forking, or in a handler run natively, and never twice
   at the place that let the signal go (let_go_pc: that would fault and hold it for good). */
static int in_branch_code(const BtCopy *found, uint64_t pc) {
  if (found == NULL || !found->whole || found->branch_end == 0)
    return 0;
  uint64_t at = pc - found->copy;
  return at > found->offsets[found->n - 1] && at < found->branch_end &&
         !is_syscall_at(found->start + found->offsets[2 * found->n - 1]);
}

/* So can one that comes inside the copy of one of the block's other instructions (one Gum
   relocated into several; the agent's checks and callouts): the block runs on to its end
   and the next record lets it go, or the check before a system call, which reads the
   header page first (put_syscall_checks).  Not inside a system call's own copy, past that
   read (the call would go in with the signal held: a pause() would wait for good), nor in
   the record's code, nor past the instructions mapped. */
static unsigned instruction_holding(const BtCopy *found, uint64_t at);

static int in_instruction_copy(const BtCopy *found, uint64_t pc) {
  if (found == NULL)
    return 0;
  uint64_t at = pc - found->copy;
  if (at < found->first_at)
    return 0;
  unsigned k = instruction_holding(found, at);
  if (k + 1 == found->n) /* the last one's branch: in_branch_code */
    return 0;
  return !is_syscall_at(found->start + found->offsets[found->n + k]);
}

static int hold_signal(BtThread *t, int sig, const uint8_t *info, const uint8_t *uc,
                       const BtCopy *found, uint8_t *under) {
  BtSigaction now;
  int segv = fault_index(11);
  uint64_t mask = *(const uint64_t *)(uc + UC_SIGMASK);
  if (sig >= 32 || t->held_sig != 0 || t->header32 == NULL ||
      t->wpp != (uint64_t *)(t->header32 + BT_OFF_INLINE_PTR) || t->next_id >= t->table_cap ||
      segv < 0 || !(STATE->faults_taken >> segv & 1) || (mask >> 10 & 1) /* SIGSEGV */ ||
      (uint64_t)STATE->chained[segv].restorer != bt_fault_restorer() /* hooked: trap_uc */ ||
      t->leaving || t->fork_kept || t->fork_native ||
      (t->handlers_running > 0 && t->handler_copy[t->handlers_running - 1] == 0) /* native */ ||
      syscall(13 /* rt_sigaction */, sig, NULL, &now, 8) != 0 || now.handler != (void *)bt_sigstub)
    return 0;
  uint64_t pc = *(const uint64_t *)(uc + UC_RIP);
  if (pc == t->let_go_pc) { /* the record or check that let it go: natively (a GAP) */
    t->let_go_pc = 0;
    return 0;
  }
  if (under == NULL && !in_branch_code(found, pc) && !in_instruction_copy(found, pc))
    return 0;
  /* without SA_SIGINFO the kernel leaves the frame's siginfo unwritten: what is there is
     stale (queueing it again failed, and the signal was lost: a program that waited for
     its handler hung) */
  t->held_with_info = (now.flags & 4 /* SA_SIGINFO */) != 0;
  for (int i = 0; i < 128; i++)
    t->held_info[i] = info[i];
  t->held_sig = sig;
  if (syscall(10 /* mprotect */, t->header32, 4096, 0 /* PROT_NONE */) != 0) {
    t->held_sig = 0;
    return 0;
  }
  t->held_for_uc = (uint64_t)under;
  BT_HDR64(&t->w, BT_OFF_COUNTED_SIGNALS_HELD) = BT_HDR64(&t->w, BT_OFF_COUNTED_SIGNALS_HELD) + 1;
  return 1;
}

/* The held signal queued again for its thread, from any thread (0: none was held). */
static int queue_held(BtThread *t) {
  int held = t->held_sig;
  if (held == 0 || swap_int((int *)&t->held_sig, held, 0) != held)
    return 0;
  t->held_for_uc = 0;
  syscall(10 /* mprotect */, t->header32, 4096, 3 /* PROT_READ|WRITE */);
  /* with its siginfo; else, or when the kernel refuses that (from another thread, for a
     siginfo of kill(), tgkill() or the kernel's own), as tgkill() would send it */
  if (!t->held_with_info ||
      syscall(297 /* rt_tgsigqueueinfo */, getpid(), t->tid, held, t->held_info) != 0)
    syscall(234 /* tgkill */, getpid(), t->tid, held);
  return held;
}

/* Off the way to the next record (the fork stub's native fork(), a thread let go of): the
   held signal now, where the thread is (natively: a GAP). */
static void settle_held_signal(BtThread *t) {
  if (t != NULL && !in_forked_child())
    queue_held(t);
}

/* From on_fault: a fault on the header page of a thread holding a signal is that thread's
   next record; the signal goes in as the fault's handler returns. */
static int let_go_held(const uint8_t *info, uint8_t *uc) {
  uint64_t address = *(const uint64_t *)(info + 16); /* si_addr */
  uint32_t tid = (uint32_t)syscall(186 /* gettid */);
  for (int i = 0; i < STATE->nthreads; i++) {
    BtThread *t = STATE->threads[i];
    if (t == NULL || t->tid != tid || t->header32 == NULL ||
        address - (uint64_t)t->header32 >= 4096)
      continue;
    int held = t->held_sig;
    uint64_t bit = held == 0 ? 0 : 1ULL << (held - 1);
    if (held != 0) /* blocked until the fault's handler returns */
      syscall(14 /* rt_sigprocmask */, 0 /* SIG_BLOCK */, &bit, NULL, 8);
    if (queue_held(t) == held && held != 0) {
      *(uint64_t *)(uc + UC_SIGMASK) &= ~bit;
      t->trap_uc = (uint64_t)uc;
      t->let_go_pc = *(const uint64_t *)(uc + UC_RIP);
    } else { /* given back meanwhile (settle_held_signal) */
      syscall(10 /* mprotect */, t->header32, 4096, 3 /* PROT_READ|WRITE */);
    }
    return 1;
  }
  return 0;
}

/* A handler runs outside Stalker, and one that returns goes back into Stalker's copy of
   the code it interrupted (its signal frame holds that pc).  One that leaves by
   siglongjmp() instead lands natively, and the thread ran on untraced for good (a handler
   that recovers from SIGSEGV: 1 of 3 calls recorded).  So the kernel's way back from a
   handler, the restorer, counts it returned (bt_on_sigreturn), and siglongjmp() called
   while a handler runs marks where the thread left it (a GAP, which breaks the chain) and
   follows the thread again from there: the jump itself and all after it are traced. */
extern void *bt_new_refollow(void);

/* The thread's refollow stub, made the first time, its hook waited for. */
static void make_refollow_stub(BtThread *t) {
  if (t->refollow != NULL)
    return;
  int turn = enter_script();
  t->refollow = bt_new_refollow();
  leave_script(turn);
  static const uint8_t nops[5] = {0x90, 0x90, 0x90, 0x90, 0x90};
  if (t->refollow != NULL)
    await_hook((uint64_t)t->refollow + BT_REFOLLOW_HOOK, nops, "refollow");
}

/* The signal frame's pc `rip` goes to the thread's refollow stub, which follows the thread
   again and jumps where the frame said (made at once when the thread has none yet). */
static void refollow_at_return(BtThread *t, uint64_t *rip) {
  make_refollow_stub(t);
  if (t->refollow != NULL) {
    *(uint64_t *)(t->refollow + BT_REFOLLOW_TARGET) = *rip;
    *rip = (uint64_t)t->refollow;
    t->renewing = 0; /* a handler that ran between on_renewal and its jump: followed again
                        as for any handler that moved the pc, its old context kept */
  }
}

void bt_on_sigreturn(GumInvocationContext *ic) {
  BtThread *t = in_forked_child() ? NULL : current_thread();
  if (t == NULL)
    return;
  if (t->trap_uc != 0 && t->trap_uc == ic->cpu_context->rsp) {
    t->trap_uc = 0; /* the fault that let a held signal go (let_go_held): no handler's */
    return;
  }
  int depth = t->handlers_running;
  if (t->handlers_running > 0)
    t->handlers_running--;
  /* the restorer is entered with the stack pointer at the signal frame's ucontext */
  uint64_t uc = ic->cpu_context->rsp;
  uint64_t *rip = (uint64_t *)(uc + UC_RIP);
  if (depth >= 1 && depth <= BT_HANDLER_DEPTH && t->handler_copy[depth - 1] != 0 &&
      t->handler_uc[depth - 1] == uc) {
    /* a handler run traced (bt_signal_enter) returns: back into the copy, the way back
       recorded as the step engine records it -- the restorer's system call, then the rest
       of the block the handler interrupted */
    uint64_t from = restorer_syscall(), copy = t->handler_copy[depth - 1];
    if (*rip == t->handler_pc[depth - 1] && t->handler_ctx[depth - 1] == t->exec_ctx &&
        !t->closed && !t->leaving) {
      write_branch(t, BT_KIND_SYSCALL, from, *rip);
      if (t->handler_last[depth - 1] != 0)
        write_block_far(t, *rip | ((t->handler_last[depth - 1] - *rip) << BT_BLOCK_ADDR_BITS));
      t->saved_rax = t->handler_saved[depth - 1][0];
      t->saved_rcx = t->handler_saved[depth - 1][1];
      *rip = copy;
      return;
    }
    if (t->closed || t->leaving)
      return; /* Stalker lets go of the thread: on natively where the frame says */
    t->handler_pc[depth - 1] = 0; /* moved, or its context renewed: followed again below */
  }
  uint64_t resume = t->fault_resume;
  t->fault_resume = 0;
  if (resume != 0 && *rip == t->fault_ip) {
    *rip = resume; /* deliver()'s handler returned: on in the copy, traced */
    return;
  }
  /* The handler moved the pc on (past a faulting instruction, or to a function, as Go's
     runtime does to panic): the thread would go on natively and untraced for good, its
     trace ending at the fault as if it had crashed there (a handler skipping the faulting
     instruction: the 3 calls after it and the rest of main missing).  It goes to the
     thread's refollow stub instead, which follows it again (bt_on_refollow), then jumps
     where the handler said. */
  if (depth < 1 || depth > BT_HANDLER_DEPTH || t->handler_uc[depth - 1] != uc ||
      *rip == t->handler_pc[depth - 1] || t->closed || is_frida_code(*rip))
    return;
  refollow_at_return(t, rip);
}

extern void bt_unfollow_me(void);
extern void bt_follow_afresh(void);
static void note_renewal(BtThread *t);
static void leave_at_renewal(BtThread *t);

/* put_renewal: the thread, native in its refollow stub's hook, leaves its context and is
   followed in a fresh one from the stub's jump on.  Where the old context's copies of its
   blocks were (BtCopy) is forgotten: the fresh one's code may be placed there. */
static void renew_context(BtThread *t) {
  /* as for fork() (bt_hold_forks_at_entry): Gum lets go of a thread at the end through its
     context, which an unfollow here would free under it */
  g_atomic_int_add(&STATE->renewals_in_flight, 1);
  if (g_atomic_int_add(&STATE->renewals_held, 0)) {
    g_atomic_int_add(&STATE->renewals_in_flight, -1);
    leave_at_renewal(t);
    return;
  }
  int turn = enter_script();
  t->exec_ctx = NULL;
  bt_unfollow_me();
  for (BtCopyChunk *c = t->copies, *prev; c != NULL; c = prev) {
    prev = c->prev;
    t->copies = prev;
    munmap(c, BT_COPY_CHUNK);
  }
  note_renewal(t);
  bt_follow_afresh();
  leave_script(turn);
  g_atomic_int_add(&STATE->renewals_in_flight, -1);
}

/* The recording is ending: the thread, native here, does not go back into Stalker but
   leaves as at its next chunk callout (on_chunk_end) once the host has closed its ring,
   so that the host, waiting for that (bt_thread_let_go), sees it gone. */
static void leave_at_renewal(BtThread *t) {
  for (int waited = 0; !t->closed && waited < 2000; waited++) {
    long pause[2] = {0, 1000000};
    syscall(35 /* nanosleep */, pause, NULL);
  }
  if (!t->closed || t->left)
    return;
  t->left = 1;
  bt_barrier();
  uint8_t *ctx = context_to_let_go(t);
  release_thread(t, 0);
  if (ctx != NULL)
    let_go_of_context(ctx);
}

/* The end of a recording (letGoOfAll in stalker_agent.js): no thread renews its context
   from now on.  Returns how many are doing so still. */
int bt_hold_renewals(void) {
  g_atomic_int_add(&STATE->renewals_held, 1);
  return g_atomic_int_add(&STATE->renewals_in_flight, 0);
}

/* The refollow stub, hooked: a thread is there with the registers its handler gave it, or
   for a fresh context (put_renewal). */
void bt_on_refollow(GumInvocationContext *ic) {
  BtThread *t = in_forked_child() ? NULL : current_thread();
  if (t == NULL || t->closed)
    return; /* the stub jumps on, natively */
  if (t->renewing) {
    t->renewing = 0;
    renew_context(t);
    return;
  }
  bt_thread_gap(t, BT_GAPREASON_LEFT_HANDLER);
  bt_follow_again();
}

void bt_on_longjmp(GumInvocationContext *ic) {
  BtThread *t = in_forked_child() ? NULL : current_thread();
  if (t == NULL || t->handlers_running == 0)
    return;
  int untraced = 0;
  for (int i = 0; i < t->handlers_running && i < BT_HANDLER_DEPTH; i++)
    untraced |= t->handler_copy[i] == 0;
  t->handlers_running = 0;
  rearm_altstack(t);
  if (!untraced)
    return; /* out of handlers run traced: the jump is in the trace */
  bt_thread_gap(t, BT_GAPREASON_LEFT_HANDLER);
  write_block_far(t, (uint64_t)ic->function); /* what the hook ran relocated (bt_on_tls_dtors) */
  bt_follow_again();
}

/* Copy n bytes from addr, or fail (0) instead of faulting when they are not mapped. */
static int read_safely(const void *addr, void *out, uint64_t n) {
  uint64_t local[2] = {(uint64_t)out, n};
  uint64_t remote[2] = {(uint64_t)addr, n};
  return syscall(310 /* process_vm_readv */, getpid(), local, 1, remote, 1, 0) == (long)n;
}

/* Note where the instructions of a block just compiled are in the copy (BtCopy). */
static void add_copy(BtThread *t, uint64_t copy, uint64_t copy_size, uint64_t start,
                     unsigned n, int whole, const uint16_t *offsets, const uint16_t *record) {
  uint64_t size = (sizeof(BtCopy) + 4 * n + 7) & ~7ULL;
  BtCopyChunk *c = t->copies;
  if (c == NULL || sizeof(BtCopyChunk) + c->used + size > BT_COPY_CHUNK) {
    BtCopyChunk *fresh = mmap(NULL, BT_COPY_CHUNK, 3, 0x22 /* PRIVATE|ANONYMOUS */, -1, 0);
    if (fresh == (BtCopyChunk *)-1)
      return; /* a fault in the block is then known by its block alone */
    fresh->prev = c;
    fresh->used = 0;
    fresh->lo = copy;
    fresh->hi = copy + copy_size;
    t->copies = c = fresh;
  }
  if (copy < c->lo)
    c->lo = copy;
  if (copy + copy_size > c->hi)
    c->hi = copy + copy_size;
  BtCopy *e = (BtCopy *)((uint8_t *)(c + 1) + c->used);
  e->copy = copy;
  e->start = start;
  e->copy_size = (uint32_t)copy_size;
  e->n = (uint16_t)n;
  e->whole = (uint16_t)whole;
  e->read_at = record[0];
  e->written_at = record[1];
  e->check_end = record[2];
  e->restore_at = record[3];
  e->first_at = record[4];
  e->branch_end = record[5];
  for (unsigned i = 0; i < 2 * n; i++)
    e->offsets[i] = offsets[i];
  /* last: a fault that interrupts this (in the thread's own handler) sees whole entries */
  *(volatile uint64_t *)&c->used = c->used + size;
}

/* The newest entry whose block's copy holds `pc` and maps an instruction, or NULL. */
static const BtCopy *copy_holding(BtThread *t, uint64_t pc) {
  for (const BtCopyChunk *c = t->copies; c != NULL; c = c->prev) {
    if (pc < c->lo || pc >= c->hi)
      continue;
    const BtCopy *found = NULL;
    for (uint64_t at = 0; at < c->used;) {
      const BtCopy *e = (const BtCopy *)((const uint8_t *)(c + 1) + at);
      if (pc >= e->copy && pc - e->copy < e->copy_size)
        found = e;
      at += (sizeof(BtCopy) + 4 * e->n + 7) & ~7ULL;
    }
    if (found != NULL && found->n != 0)
      return found;
  }
  return NULL;
}

/* Which of the instructions mapped in `found` the copy's byte at offset `at` belongs to
   (the last one's copy runs on to the block's end). */
static unsigned instruction_holding(const BtCopy *found, uint64_t at) {
  unsigned k = 0;
  while (k + 1 < found->n && found->offsets[k + 1] <= at)
    k++;
  return k;
}

/* The program's instruction that Stalker's copy holds at `pc`, or 0. */
static uint64_t program_address(BtThread *t, uint64_t pc) {
  const BtCopy *found = copy_holding(t, pc);
  if (found == NULL)
    return 0;
  unsigned k = instruction_holding(found, pc - found->copy);
  if (k + 1 == found->n && !found->whole)
    return 0; /* in the last instruction mapped, or in one after it */
  return found->start + found->offsets[found->n + k];
}

/* The program's instruction whose copy starts exactly at `pc` (0: none), `found` the copy
   entry holding `pc` (copy_holding), and the last instruction of its block (`last`, 0: not
   known).  `at_start`: `pc` is the block's first, before the code of its record: the record
   is then still to be written. */
static int is_vfork_return(uint64_t pc);

static uint64_t copied_instruction_at(const BtCopy *found, uint64_t pc, uint64_t *last,
                                      int *at_start) {
  if (found == NULL)
    return 0;
  *last = found->whole ? found->start + found->offsets[2 * found->n - 1] : 0;
  uint64_t at = pc - found->copy;
  *at_start = at <= found->read_at;
  if (*at_start)
    return found->start; /* its record to be written, nothing of the block run yet */
  if ((at >= found->written_at && at < found->check_end) ||
      (at >= found->restore_at && at <= found->first_at))
    return found->start; /* its record written, nothing of the block run yet */
  for (unsigned k = 0; k < found->n; k++)
    if (found->offsets[k] == at)
      return found->start + found->offsets[found->n + k];
  /* A system call's copy starts with the agent's checks before it (put_syscall_checks):
     a signal that interrupted a blocking one the kernel restarts (SA_RESTART: a futex,
     read()) comes with the pc set back to the `syscall` instruction itself, the program's
     registers as they were for it (a thread in pthread_join() took its timer signals so,
     all natively, before). */
  unsigned k = instruction_holding(found, at);
  uint64_t address = found->start + found->offsets[found->n + k];
  if (found->offsets[k] < at && (k + 1 < found->n || found->whole) && is_syscall_at(pc) &&
      is_syscall_at(address))
    return address;
  /* The parent back from put_vfork's own system call: a signal pending as it returns (the
     SIGCHLD of a child that has exited) comes right after it, where the program's next
     instruction is due.  Its handler ran natively there, marked by a GAP (37 of 40 runs of
     vforksig's SIGCHLD handler). */
  if (found->offsets[k] < at && is_syscall_at(address) && is_vfork_return(pc))
    return address + 2;
  return 0;
}

static int is_syscall_at(uint64_t address) {
  uint8_t code[2];
  return read_safely((const void *)address, code, 2) && code[0] == 0x0f && code[1] == 0x05;
}

static int same_bytes(const uint8_t *a, const uint8_t *b, unsigned n);

/* Whether `pc` is where put_vfork's system call returns: after its `syscall`, at its
   `mov rcx, rax; jrcxz child; movabs rcx`. */
static int is_vfork_return(uint64_t pc) {
  static const uint8_t after[9] = {0x0f, 0x05, 0x48, 0x89, 0xc1, 0xe3, 0x0f, 0x48, 0xb9};
  uint8_t code[9];
  return read_safely((const void *)(pc - 2), code, 9) && same_bytes(code, after, 9);
}

/* The signals on_fault() takes.  Those that name an instruction in a FAULT record: the
   kernel raises SIGSEGV, SIGBUS, SIGILL and SIGFPE as an instruction runs (si_code > 0),
   and SIGABRT when the thread raises it at itself with a system call (abort()). */
static const int fault_signals[BT_FAULT_SIGNALS] = {11 /* SIGSEGV */, 7 /* SIGBUS */,
                                                    4 /* SIGILL */,  8 /* SIGFPE */,
                                                    6 /* SIGABRT */, 5 /* SIGTRAP */,
                                                    31 /* SIGSYS */};

static int fault_index(int sig) {
  for (int i = 0; i < BT_FAULT_SIGNALS; i++)
    if (fault_signals[i] == sig)
      return i;
  return -1;
}

static void note_program_action(int sig, void *handler, uint64_t flags, uint64_t mask) {
  int i = fault_index(sig);
  if (i < 0)
    return;
  BtSigaction action = {handler, flags, NULL, mask};
  STATE->program[i] = action;
  STATE->program_known |= 1ULL << i;
}

/* The handlers the program set before the agent came in (an attach; a library's constructor
   before a spawned program's _init), as if set now: their entries are marked (note_handler),
   else each of their runs went unmarked in the trace, and a fault signal's goes through
   deliver().  Asked of sigaction(), which Frida takes: for a fault signal it answers what
   the program set, not the handler Frida put in the kernel.  A handler the program sets
   meanwhile is noted by the hooks, and not overwritten here with what it replaced. */
extern int sigaction(int sig, const void *act, void *old);

void bt_note_set_handlers(void) {
  for (int sig = 1; sig <= 64; sig++) {
    uint8_t old[152] = {0}; /* glibc's struct sigaction, as in bt_on_sigaction */
    BtSigaction kernels;
    if (sigaction(sig, NULL, old) != 0) { /* SIGKILL, SIGSTOP, glibc's own (32, 33) */
      if ((sig != 32 && sig != 33) || syscall(13 /* rt_sigaction */, sig, NULL, &kernels, 8))
        continue;
      *(void **)old = kernels.handler; /* set_glibcs_own */
    }
    void *handler = (void *)handler_behind(sig, *(uint64_t *)old);
    if ((uint64_t)handler <= 1 || is_frida_code((uint64_t)handler))
      continue;
    note_handler(handler);
    adopt_handler(sig, 0);
    int i = fault_index(sig);
    if (i >= 0 && !(STATE->program_known >> i & 1))
      note_program_action(sig, handler, *(uint32_t *)(old + 136), *(uint64_t *)(old + 8));
  }
}

/* Before an rt_sigaction() system call in the program's own code (put_syscall_checks), for a
   fault signal: a runtime that sets its handlers with the call itself (Go's) took
   on_fault()'s place, and its faults were not in the trace.  The call is made through
   sigaction() instead, which Frida takes, as it takes the program's other calls: the
   handler is Frida's to give back at the end (its exceptor then restores what it knows),
   the agent's hook on sigaction() notes it for deliver(), and the system call itself is
   made to change nothing.  Anything the kernel would refuse goes to it as asked. */

static void set_glibcs_own(GumCpuContext *cpu);

static void on_rt_sigaction(GumCpuContext *cpu, gpointer user_data) {
  if ((cpu->rdi == 32 || cpu->rdi == 33) && cpu->rsi != 0 && cpu->r10 == 8 &&
      !in_forked_child()) {
    set_glibcs_own(cpu);
    return;
  }
  int i = fault_index((int)cpu->rdi);
  BtSigaction act, old;
  uint8_t glibc_act[152] = {0}, glibc_old[152] = {0}; /* glibc's struct sigaction */
  if (i < 0 || !(STATE->faults_taken & (1ULL << i)) || cpu->r10 != 8 || in_forked_child())
    return;
  if (cpu->rsi != 0) {
    if (!read_safely((const void *)cpu->rsi, &act, sizeof act))
      return;
    *(void **)glibc_act = act.handler;
    *(uint64_t *)(glibc_act + 8) = act.mask;
    *(uint32_t *)(glibc_act + 136) = (uint32_t)act.flags & ~0x04000000U /* SA_RESTORER */;
  }
  if (sigaction((int)cpu->rdi, cpu->rsi != 0 ? glibc_act : NULL, glibc_old) != 0)
    return;
  old.handler = *(void **)glibc_old;
  old.flags = *(uint32_t *)(glibc_old + 136);
  old.restorer = *(void **)(glibc_old + 144);
  old.mask = *(uint64_t *)(glibc_old + 8);
  uint64_t local[2] = {(uint64_t)&old, sizeof old}, remote[2] = {cpu->rdx, sizeof old};
  if (cpu->rdx != 0)
    syscall(311 /* process_vm_writev */, getpid(), local, 1, remote, 1, 0);
  cpu->rsi = 0; /* rt_sigaction(sig, NULL, NULL): 0, nothing changed */
  cpu->rdx = 0;
}

/* glibc's own signals, SIGCANCEL (32: pthread_cancel()) and SIGSETXID (33: setuid() and
   the like in a threaded process), whose handlers its sigaction() sets for nobody else:
   glibc sets them with the system call itself, SIGCANCEL's as a thread first cancels
   another.  They went unhooked, so a thread cancelled in a system call ran the handler,
   the unwinding and its cleanup handlers natively, and its trace went on, with no GAP,
   where the thread's end followed it again (__call_tls_dtors): a thread cancelled in
   sleep() had 132 distinct branches where the step engine had 315.  Here the call is made by the agent, the handler's entry hooked and the
   signal stub put in front of it (adopt_handler), as for the program's own; the program's
   call is left to ask for nothing, and told the old action. */
static void set_glibcs_own(GumCpuContext *cpu) {
  BtSigaction act, old;
  if (!read_safely((const void *)cpu->rsi, &act, sizeof act))
    return;
  note_handler(act.handler);
  if (syscall(13 /* rt_sigaction */, (int)cpu->rdi, &act, &old, 8) != 0)
    return; /* the program's own call gets the same error */
  adopt_handler((int)cpu->rdi, 0);
  uint64_t local[2] = {(uint64_t)&old, sizeof old}, remote[2] = {cpu->rdx, sizeof old};
  if (cpu->rdx != 0)
    syscall(311 /* process_vm_writev */, getpid(), local, 1, remote, 1, 0);
  cpu->rsi = 0; /* rt_sigaction(sig, NULL, NULL): 0, nothing changed */
  cpu->rdx = 0;
}

/* Whether the instruction that raised the signal raises it again as the handler returns
   (it did not complete): a fault, not a signal sent, a breakpoint or a system call's. */
static int raised_again(int sig, int32_t code) {
  return code > 0 && (sig == 11 || sig == 7 || sig == 4 || sig == 8);
}

/* The FAULT record of a fault of a thread of ours, in its signal handler, before any of the
   program's (docs/format.md).  The interrupted pc is in Stalker's copy of the code, so
   the program's instruction comes from the copy's map; a pc in the program's own code is
   code the thread ran untraced (a signal handler).  Offsets in the ucontext and siginfo
   are x86-64 Linux's.  Returns the program's instruction when the pc was in the copy. */
static uint64_t write_fault(BtThread *t, int sig, const uint8_t *info, const uint8_t *uc) {
  int32_t code = *(const int32_t *)(info + 8);
  if (sig == 6 ? code != -6 /* SI_TKILL */ || *(const int32_t *)(info + 16) != getpid()
               : !raised_again(sig, code))
    return 0; /* sent by a process, or not about one instruction */
  if (t == NULL || t->in_c || t->closed)
    return 0;
  uint64_t pc = *(const uint64_t *)(uc + UC_RIP);
  const BtCodeRange *range = code_range(pc);
  if (range != NULL && range->fridas)
    return 0; /* Frida's own (a read it guards) */
  uint64_t ip = range != NULL ? pc : program_address(t, pc);
  if (sig == 6) { /* pc is after the system call that raised it: the next instruction */
    if (ip != 0 && is_syscall_at(ip))
      ip += 2; /* the copy holds the call's instruction and Stalker's code after it */
    else if (ip == 0 || !is_syscall_at(ip - 2))
      return 0;
  }
  int memory = sig == 11 || sig == 7; /* SIGSEGV, SIGBUS: si_addr is the memory */
  uint64_t address = memory ? *(const uint64_t *)(info + 16) : 0;
  uint64_t access = 0; /* FaultAccess: from a page fault's error code */
  if (memory && *(const uint64_t *)(uc + 200) == 14 /* REG_TRAPNO: #PF */) {
    uint64_t error = *(const uint64_t *)(uc + 192); /* REG_ERR */
    access = error & 16 ? 3 /* instruction fetch */ : error & 2 ? 2 /* write */ : 1;
  }
  long ts[2];
  clock_gettime(1 /* CLOCK_MONOTONIC */, ts);
  uint64_t fault[6] = {bt_escape(BT_RECORDTYPE_FAULT, 5, (uint64_t)sig),
                       (uint64_t)(ts[0] * 1000000000L + ts[1]) & BT_PAYLOAD_MASK,
                       ip & BT_PAYLOAD_MASK, address & BT_PAYLOAD_MASK, access,
                       (uint64_t)(uint32_t)code};
  enter_c(t);
  if (!t->closed) {
    sync_head(t);
    write_counted(t, fault, 6);
    refill(t);
  }
  leave_c(t);
  return range != NULL ? 0 : ip;
}

/* handler(sig, info, uc) called with its stack pointer at `sp`. */
extern void bt_call_on_stack(void *handler, long sig, void *info, void *uc, uint64_t sp);
__asm__(".text\n"
        ".globl bt_call_on_stack\n"
        "bt_call_on_stack:\n"
        "  push %rbp\n"
        "  mov %rsp, %rbp\n"
        "  mov %r8, %rsp\n"
        "  mov %rdi, %rax\n"
        "  mov %rsi, %rdi\n"
        "  mov %rdx, %rsi\n"
        "  mov %rcx, %rdx\n"
        "  call *%rax\n"
        "  mov %rbp, %rsp\n"
        "  pop %rbp\n"
        "  ret\n");

#define UC_STACK 16 /* uc_stack: the signal stack as the signal found it */
#define UC_RSP 160  /* uc_mcontext.gregs[REG_RSP] */

/* Whether a fault is the stack's overflow: SIGSEGV at an address near the stack pointer,
   unmapped (the gap below the main thread's stack) or a guard page (a thread's). */
static int overflowed(int sig, const uint8_t *info, uint64_t rsp, uint64_t sp) {
  int32_t code = *(const int32_t *)(info + 8);
  uint64_t address = *(const uint64_t *)(info + 16);
  return sig == 11 && (code == 1 /* SEGV_MAPERR */ || code == 2 /* SEGV_ACCERR */) &&
         address + 65536 >= sp && address < rsp + 65536;
}

/* The kernel, finding no room on an overflowed stack for a handler's frame, kills the
   process with SIGSEGV: so it is, at the program's instruction, which faults again as the
   handler returns, or by SIGSEGV raised now and delivered then. */
static void die_of_overflow(const BtSigaction *chained, int sig, const uint8_t *info) {
  BtSigaction dfl = *chained;
  dfl.handler = (void *)0 /* SIG_DFL */;
  syscall(13 /* rt_sigaction */, 11 /* SIGSEGV */, &dfl, NULL, 8);
  if (!raised_again(sig, *(const int32_t *)(info + 8)))
    syscall(234 /* tgkill */, getpid(), syscall(186 /* gettid */), 11);
}

/* Where the kernel would have put the signal frame on the thread's stack, the frame's
   place `frame` modulo 64 kept (its FPU state is 64-byte aligned), or 0 when an overflowed
   stack has no room for it.  A stack not yet grown that far grows as it is written, as it
   would have for the frame. */
static uint64_t frame_on_thread_stack(int sig, const uint8_t *info, const uint8_t *uc,
                                      uint64_t frame, uint64_t len) {
  uint64_t rsp = *(const uint64_t *)(uc + UC_RSP);
  uint64_t at = ((rsp - 128 - len - 64) & ~63ULL) + (frame & 63);
  uint8_t probe;
  if (!read_safely((const void *)at, &probe, 1) && overflowed(sig, info, rsp, at))
    return 0;
  return at;
}

/* The program's handler (behind Frida's) runs where the kernel would have run it on a
   thread without a signal stack: on the thread's stack below the interrupted one's red
   zone, by the signal frame's size.  0 when an overflowed stack has no room there. */
static int run_on_thread_stack(const BtSigaction *chained, int sig, uint8_t *info,
                               uint8_t *uc, const uint8_t *altstack) {
  uint64_t frame = (uint64_t)uc - 8;
  uint64_t len = (uint64_t)(altstack + BT_ALTSTACK_SIZE) - frame;
  uint64_t at = frame_on_thread_stack(sig, info, uc, frame, len);
  if (at == 0)
    return 0;
  bt_call_on_stack(chained->handler, sig, info, uc, at & ~15ULL);
  return 1;
}

/* handler(sig, info, uc) entered with its stack pointer at `sp`, for good. */
extern void bt_enter_handler(void *handler, long sig, void *info, void *uc, uint64_t sp);
__asm__(".text\n"
        ".globl bt_enter_handler\n"
        "bt_enter_handler:\n"
        "  mov %r8, %rsp\n"
        "  mov %rdi, %rax\n"
        "  mov %rsi, %rdi\n"
        "  mov %rdx, %rsi\n"
        "  mov %rcx, %rdx\n"
        "  jmp *%rax\n");

#define SA_ONSTACK 0x08000000
#define SA_NODEFER 0x40000000
#define SA_RESETHAND 0x80000000ULL
#define UC_FPREGS 224   /* uc_mcontext.fpregs: where the frame keeps the FPU state */

/* Where the kernel's signal frame ends: after its FPU state (the size its
   software-reserved bytes give: FP_XSTATE_MAGIC1, extended_size), or after the siginfo
   when it has none. */
static uint64_t frame_end(const uint8_t *info, const uint8_t *uc) {
  const uint8_t *fpstate = *(const uint8_t *const *)(uc + UC_FPREGS);
  uint64_t end = (uint64_t)info + 128;
  if (fpstate != NULL) {
    uint32_t magic = *(const uint32_t *)(fpstate + 464);
    uint64_t size = magic == 0x46505853 ? *(const uint32_t *)(fpstate + 468) : 512;
    if ((uint64_t)fpstate + size > end)
      end = (uint64_t)fpstate + size;
  }
  return (end + 7) & ~7ULL;
}

/* A fault of the program's own code, for a handler the program set: entered as the kernel
   would have entered it, not through Frida's handler, which calls it as a function from
   code that no unwinder knows (a crash handler's backtrace() stopped there: 2 frames, 8
   untraced).  Its signal frame is where the kernel would have put it -- the thread's
   stack, or the program's own signal stack for a SA_ONSTACK handler -- its return address
   the restorer, through which backtrace() unwinds into the program's frames, and the mask
   the program's.  The handler returns through the restorer (bt_on_sigreturn), which sends
   the thread on in Stalker's copy of the instruction, traced.  Returns only when an
   overflowed stack has no room for the frame (0). */
static int deliver(BtThread *t, int i, int sig, uint8_t *info, uint8_t *uc, uint64_t ip,
                   uint64_t in_copy) {
  const BtSigaction *action = &STATE->program[i];
  const BtStack *found = (const BtStack *)(uc + UC_STACK); /* the stack it was delivered on */
  uint8_t here;
  uint64_t frame = (uint64_t)uc - 8; /* its return address, then the ucontext */
  int on_a_stack = found->sp != NULL && &here >= (uint8_t *)found->sp &&
                   &here < (uint8_t *)found->sp + found->size;
  int programs = on_a_stack && agents_altstack(found->sp) == NULL;
  uint64_t entry = frame;
  if (on_a_stack && !(programs && (action->flags & SA_ONSTACK))) {
    uint64_t top = frame_end(info, uc), len = top - frame;
    uint64_t at = frame_on_thread_stack(sig, info, uc, frame, len);
    if (at == 0)
      return 0;
    uint64_t *from = (uint64_t *)frame, *to = (uint64_t *)at;
    for (uint64_t k = 0; k < len / 8; k++)
      to[k] = from[k];
    uint64_t shift = at - frame;
    uint64_t *fpregs = (uint64_t *)(uc + shift + UC_FPREGS);
    if (*fpregs >= frame && *fpregs < top)
      *fpregs += shift;
    info += shift;
    uc += shift;
    entry = at;
  }
  t->fault_ip = ip;
  t->fault_resume = in_copy;
  uint64_t mask = *(uint64_t *)(uc + UC_SIGMASK) | action->mask;
  if (!(action->flags & SA_NODEFER))
    mask |= 1ULL << (sig - 1);
  syscall(14 /* rt_sigprocmask */, 2 /* SIG_SETMASK */, &mask, NULL, 8);
  bt_enter_handler(action->handler, sig, info, uc, entry);
  return 1;
}

void bt_note(const char *line);

static int put_text(char *out, int at, const char *text) {
  while (*text != 0)
    out[at++] = *text++;
  return at;
}

static int put_hex_string(char *out, int at, uint64_t v) {
  at = put_text(out, at, "\"0x");
  int shift = 60;
  while (shift > 0 && (v >> shift) == 0)
    shift -= 4;
  for (; shift >= 0; shift -= 4)
    out[at++] = "0123456789abcdef"[(v >> shift) & 15];
  return put_text(out, at, "\"");
}

/* {"type": "frida-fault", "tid": N, "signal": S, "pc": "0x..", "address": "0x.."}: the
   process is about to die of a fault (or a breakpoint: GLib's g_error()) whose instruction
   is in Frida's agent, where no FAULT record names one of the program's -- Frida's handler
   gave the default action back.  The recorder says so, rather than show the program's
   crash with no site.  Stalker running out of room for a thread's code is one (README,
   "Stalker's limit"). */
static void note_frida_fault(int sig, const uint8_t *info, const uint8_t *uc) {
  uint64_t pc = *(const uint64_t *)(uc + UC_RIP);
  const BtCodeRange *range = code_range(pc);
  int32_t code = *(const int32_t *)(info + 8);
  if (!(raised_again(sig, code) || (sig == 5 /* SIGTRAP */ && code > 0)) || range == NULL
      || !range->fridas)
    return;
  char line[192];
  int at = put_text(line, 0, "{\"type\": \"frida-fault\", \"tid\": ");
  at = put_decimal(line, at, (uint32_t)syscall(186 /* gettid */));
  at = put_decimal(line, put_text(line, at, ", \"signal\": "), (uint32_t)sig);
  at = put_hex_string(line, put_text(line, at, ", \"pc\": "), pc);
  uint64_t address = sig == 11 || sig == 7 ? *(const uint64_t *)(info + 16) : 0;
  at = put_hex_string(line, put_text(line, at, ", \"address\": "), address);
  line[put_text(line, at, "}\n")] = 0;
  bt_note(line);
}

/* The handlers after on_fault() see the program's instruction in the signal's context,
   not Stalker's copy of it, which no unwinder or crash reporter knows.  A process that
   dies of the signal dies there too (a core dump shows the program's pc), and one whose
   handler returns resumes in the copy, traced. */
static void on_fault(int sig, void *info, void *uc) {
  if (sig == 11 && !in_forked_child() && let_go_held(info, uc))
    return;
  uint64_t *rip = (uint64_t *)((uint8_t *)uc + UC_RIP);
  uint64_t in_copy = *rip;
  BtThread *t = in_forked_child() ? NULL : current_thread(); /* one of ours, traced */
  uint64_t ip = write_fault(t, sig, info, uc);
  if (ip != 0)
    *rip = ip;
  int i = 0;
  while (fault_signals[i] != sig)
    i++;
  BtSigaction *chained = &STATE->chained[i];
  const BtSigaction *program = &STATE->program[i];
  if (t != NULL)
    t->fault_resume = 0;
  if (ip != 0 && (STATE->program_known >> i & 1) && (uint64_t)program->handler > 1 &&
      !(program->flags & SA_RESETHAND)) {
    deliver(t, i, sig, info, uc, ip, in_copy); /* returns only for want of room */
    die_of_overflow(chained, sig, info);
    return;
  }
  const BtStack *delivered_on = (const BtStack *)((uint8_t *)uc + UC_STACK);
  uint8_t *altstack = agents_altstack(delivered_on->sp);
  uint8_t here;
  if (altstack != NULL && (&here < altstack || &here >= altstack + BT_ALTSTACK_SIZE))
    altstack = NULL; /* not on it: the signal came as the thread was already on a stack */
  if (chained->handler == (void *)0 /* SIG_DFL */)
    syscall(13 /* rt_sigaction */, sig, chained, NULL, 8);
  else if (chained->handler == (void *)1 /* SIG_IGN */)
    ;
  else if (altstack != NULL) {
    if (!run_on_thread_stack(chained, sig, info, uc, altstack)) {
      die_of_overflow(chained, sig, info);
      return;
    }
  } else if (chained->flags & 4 /* SA_SIGINFO */)
    ((void (*)(int, void *, void *))chained->handler)(sig, info, uc);
  else
    ((void (*)(int))chained->handler)(sig);
  BtSigaction now;
  if (syscall(13, sig, NULL, &now, 8) != 0 || now.handler != (void *)0) {
    if (ip != 0 && *rip == ip)
      *rip = in_copy; /* a handler recovered: the thread goes on where it was, traced */
    return;
  }
  /* The default action is back (Frida's handler gives it back when the program has none of
     its own, and returns): the process is to die of this signal, as it does untraced.  A
     fault does as the handler returns, at the program's instruction; anything else would
     be lost (a breakpoint, a signal sent, which the program survived) or raised later
     (abort() would go on and raise its SIGABRT again), so it is raised again now, blocked
     until the handler returns: it is delivered where the thread was. */
  if (ip == 0)
    note_frida_fault(sig, info, uc);
  if (!raised_again(sig, *(const int32_t *)((const uint8_t *)info + 8))) {
    uint64_t mask = 1ULL << (sig - 1);
    syscall(14 /* rt_sigprocmask */, 0 /* SIG_BLOCK */, &mask, NULL, 8);
    syscall(234 /* tgkill */, getpid(), syscall(186 /* gettid */), sig);
  }
}

/* on_fault() takes the place of each fault signal's handler in the kernel (Frida's, which
   keeps the program's own behind it: they run after), with its flags, mask and restorer.
   Frida's way to that point (Process.setExceptionHandler) runs JavaScript in the handler,
   which may need the malloc lock that a crash inside malloc() holds.  A signal without a
   restorer to return through keeps its handler. */
void bt_catch_faults(void) {
  STATE->faults_taken = 0;
  STATE->program_known = 0; /* before the sigaction() hooks go in */
  for (int i = 0; i < BT_FAULT_SIGNALS; i++) {
    BtSigaction old, mine;
    if (syscall(13 /* rt_sigaction */, fault_signals[i], NULL, &old, 8) != 0 ||
        !(old.flags & 0x04000000 /* SA_RESTORER */))
      continue;
    STATE->chained[i] = old;
    mine = old;
    mine.handler = (void *)on_fault;
    mine.flags |= 4 /* SA_SIGINFO */ | 0x08000000 /* SA_ONSTACK: the agent's (arm_altstack) */;
    if (syscall(13, fault_signals[i], &mine, NULL, 8) == 0)
      STATE->faults_taken |= 1ULL << i;
  }
}

/* The handlers on_fault() took the place of go back, as this code is about to go. */
void bt_release_faults(void) {
  for (int i = 0; i < BT_FAULT_SIGNALS; i++) {
    BtSigaction now;
    if (!(STATE->faults_taken & (1ULL << i)))
      continue;
    if (syscall(13, fault_signals[i], NULL, &now, 8) == 0 && now.handler == (void *)on_fault)
      syscall(13, fault_signals[i], &STATE->chained[i], NULL, 8);
  }
  STATE->faults_taken = 0;
}

/* The restorer the handlers on_fault() took had (libc's __restore_rt), or 0. */
uint64_t bt_fault_restorer(void) {
  for (int i = 0; i < BT_FAULT_SIGNALS; i++)
    if (STATE->faults_taken & (1ULL << i))
      return (uint64_t)STATE->chained[i].restorer;
  return 0;
}

/* The notes file (stalker_agent.js): a line appended with open, write and close alone, no
   stdio and no malloc, whose locks a fork() under way in another thread holds (a note
   written through the script's File API left a program stuck now and then). */
extern const char bt_notes_path[];

static int put_text(char *out, int at, const char *text);
static uint64_t *stub_slot(uint64_t offset);

/* The kernel gives a signal sent to the process to any thread not blocking it, Frida's
   too, and the program's handler then runs there, in no trace: counted by the signal stub
   (signal_enter), noted as the process ends (its exit_group(), or the end of the
   recording: the host keeps the largest count a process noted).  A process killed by a
   signal notes none. */
void bt_note_off_trace(void) {
  uint32_t n = (uint32_t)g_atomic_int_add((int *)stub_slot(BT_SIGSTUB_OFF_TRACE), 0);
  if (n == 0)
    return;
  char line[96];
  int at = put_decimal(line, put_text(line, 0, "{\"type\": \"handlers-off-trace\", \"n\": "), n);
  line[put_text(line, at, "}\n")] = 0;
  bt_note(line);
}

void bt_note(const char *line) {
  int fd = open(bt_notes_path, 01 | 0100 | 02000 | 02000000 /* WRONLY|CREAT|APPEND|CLOEXEC */,
                0644);
  if (fd < 0)
    return;
  syscall(1 /* write */, fd, line, strlen(line));
  close(fd);
}

/* {"type": "context-renewed", "tid": N, "blocks": B} for renew_context(). */
static void note_renewal(BtThread *t) {
  char line[128];
  int at = put_text(line, 0, "{\"type\": \"context-renewed\", \"tid\": ");
  at = put_decimal(line, at, t->tid);
  at = put_decimal(line, put_text(line, at, ", \"blocks\": "), t->ctx_blocks);
  line[put_text(line, at, "}\n")] = 0;
  bt_note(line);
}

/* {"type": "late-hook", "tid": N, "what": WHAT} for await_hook(). */
static void note_late_hook(const char *what) { /* "refollow", "handler" or "restorer" */
  char line[128];
  int at = put_text(line, 0, "{\"type\": \"late-hook\", \"tid\": ");
  at = put_decimal(line, at, (uint32_t)syscall(186 /* gettid */));
  at = put_text(line, put_text(line, at, ", \"what\": \""), what);
  line[put_text(line, at, "\"}\n")] = 0;
  bt_note(line);
}

/* Stalker's inline cache for indirect calls, jumps and returns holds 2 targets per site by
   default and replaces the oldest on a miss, so a site with more targets (a dispatch table, a
   virtual call, a comparator shared by sorts) misses every time and takes Stalker's slow path:
   measured, 60M calls through a 4-entry table took 8.8 s instead of 0.30 s with 32 entries.
   The JS runtime's Stalker takes no options, so the count is set in the object itself, once,
   before the first block of any thread is compiled (every cache is sized from it), and only
   when the object reads back exactly as Frida 17's GumStalker: ic_entries 2 and adj_blocks 0
   right after the GObject header, followed by its fixed slab sizes.  Otherwise it stays 2 and
   the host is told (meta.json "inline_cache"). */
#define BT_STRING(x) #x
#define BT_NUMBER(x) BT_STRING(x)
#define BT_IC_NOTE(entries) "{\"type\": \"inline-cache\", \"entries\": " entries "}\n"

static void widen_inline_cache(GumStalkerIterator *iterator) {
  if (STATE->ic_done)
    return;
  if (g_atomic_int_add(&STATE->ic_ticket, 1) != 0) {
    while (!STATE->ic_done)
      ; /* another thread's first block is widening it: compile nothing before */
    return;
  }
  uint8_t *exec_ctx = *(uint8_t **)iterator; /* GumStalkerIterator.exec_context */
  uint8_t *stalker = NULL;
  uint32_t counts[2] = {0, 0};
  uint64_t sizes[15];
  int entries = 2;
  if (read_safely(exec_ctx + 16, &stalker, 8) /* GumExecCtx.stalker */
      && read_safely(stalker + 24, counts, 8) && read_safely(stalker + 32, sizes, 8 * 15)
      && counts[0] == 2 && counts[1] == 0 && sizes[5] == 128 * 1024 && sizes[6] == 4 << 20
      && sizes[8] == 128 * 1024 && sizes[9] == 4 << 20 && sizes[14] == 16384) {
    *(uint32_t *)(stalker + 24) = BT_IC_ENTRIES;
    entries = BT_IC_ENTRIES;
    STATE->stalker = stalker;
  }
  STATE->ic_done = 1;
  bt_note(entries == BT_IC_ENTRIES ? BT_IC_NOTE(BT_NUMBER(BT_IC_ENTRIES)) : BT_IC_NOTE("2"));
}

static void put_bytes(GumX86Writer *cw, const uint8_t *bytes, unsigned n) {
  gum_x86_writer_put_bytes(cw, bytes, n);
}

/* The general-purpose register (0 rax .. 15 r15) that capstone register `reg` is part of,
   or -1; *full says whether writing `reg` defines all 64 bits (a 32-bit write zero-extends,
   an 8- or 16-bit write merges). */
static int gpr_of(unsigned reg, int *full) {
  static const unsigned wide[16] = {
      X86_REG_RAX, X86_REG_RCX, X86_REG_RDX, X86_REG_RBX, X86_REG_RSP, X86_REG_RBP,
      X86_REG_RSI, X86_REG_RDI, X86_REG_R8,  X86_REG_R9,  X86_REG_R10, X86_REG_R11,
      X86_REG_R12, X86_REG_R13, X86_REG_R14, X86_REG_R15};
  static const unsigned dword[16] = {
      X86_REG_EAX, X86_REG_ECX, X86_REG_EDX,  X86_REG_EBX,  X86_REG_ESP,  X86_REG_EBP,
      X86_REG_ESI, X86_REG_EDI, X86_REG_R8D,  X86_REG_R9D,  X86_REG_R10D, X86_REG_R11D,
      X86_REG_R12D, X86_REG_R13D, X86_REG_R14D, X86_REG_R15D};
  static const unsigned word[16] = {
      X86_REG_AX, X86_REG_CX, X86_REG_DX,   X86_REG_BX,   X86_REG_SP,   X86_REG_BP,
      X86_REG_SI, X86_REG_DI, X86_REG_R8W,  X86_REG_R9W,  X86_REG_R10W, X86_REG_R11W,
      X86_REG_R12W, X86_REG_R13W, X86_REG_R14W, X86_REG_R15W};
  static const unsigned byte[16] = {
      X86_REG_AL,  X86_REG_CL,  X86_REG_DL,   X86_REG_BL,   X86_REG_SPL,  X86_REG_BPL,
      X86_REG_SIL, X86_REG_DIL, X86_REG_R8B,  X86_REG_R9B,  X86_REG_R10B, X86_REG_R11B,
      X86_REG_R12B, X86_REG_R13B, X86_REG_R14B, X86_REG_R15B};
  static const unsigned high[4] = {X86_REG_AH, X86_REG_CH, X86_REG_DH, X86_REG_BH};
  *full = 1;
  for (int i = 0; i < 16; i++)
    if (reg == wide[i] || reg == dword[i])
      return i;
  *full = 0;
  for (int i = 0; i < 16; i++)
    if (reg == word[i] || reg == byte[i] || (i < 4 && reg == high[i]))
      return i;
  return -1;
}

#define STATUS_FLAGS_TESTED                                                                \
  (X86_EFLAGS_TEST_OF | X86_EFLAGS_TEST_SF | X86_EFLAGS_TEST_ZF | X86_EFLAGS_TEST_PF |     \
   X86_EFLAGS_TEST_CF | X86_EFLAGS_TEST_AF)

/* An instruction after which the block's own instructions may not run on in sequence: a
   transfer, a trap, or an access that can fault (a SIGSEGV handler that resumes may read
   any register).  Stack and rip-relative data and thread-local storage count as mapped. */
static int ends_lookahead(csh h, const cs_insn *insn) {
  const cs_x86 *x = &insn->detail->x86;
  if (cs_insn_group(h, insn, CS_GRP_JUMP) || cs_insn_group(h, insn, CS_GRP_CALL) ||
      cs_insn_group(h, insn, CS_GRP_RET) || cs_insn_group(h, insn, CS_GRP_INT) ||
      cs_insn_group(h, insn, CS_GRP_IRET) || cs_insn_group(h, insn, CS_GRP_PRIVILEGE))
    return 1;
  switch (insn->id) {
  case X86_INS_SYSCALL: case X86_INS_SYSENTER: case X86_INS_UD2: case X86_INS_HLT:
  case X86_INS_DIV: case X86_INS_IDIV: case X86_INS_XBEGIN: case X86_INS_XABORT:
    return 1;
  case X86_INS_LEA: case X86_INS_NOP:
    return 0;
  }
  for (int i = 0; i < x->op_count; i++) {
    const cs_x86_op *op = &x->operands[i];
    if (op->type != X86_OP_MEM)
      continue;
    if (op->mem.index != X86_REG_INVALID)
      return 1;
    if (op->mem.base == X86_REG_RIP || op->mem.base == X86_REG_RSP)
      continue;
    if (op->mem.base == X86_REG_INVALID &&
        (op->mem.segment == X86_REG_FS || op->mem.segment == X86_REG_GS))
      continue;
    return 1;
  }
  return 0;
}

/* Stalker links each block to the one its branch reaches (a backpatch) once it has asked
   Gum's gum_x86_reader_disassemble_instruction_at() what that branch is, and that function
   opens a capstone handle for the one instruction and closes it again: cs_open() builds
   capstone's x86 instruction table (15,000 entries, 30 KB cleared a byte at a time) each
   time.  Recording `python3 -c pass` spent 40% of all its samples there (perf: 22% in a
   byte-wise memset, 18% in the table's loop).  The script puts bt_disassemble_at in its
   place when bt_gum_reader_at finds it (bt_gum_reader_install): the same instruction, the
   same way, from one of a few handles kept open, each taken by one caller at a time; a
   caller that finds none free (a nested call from a signal handler, a forked child whose
   parent's thread held one) opens its own, as Gum did. */
#define BT_READERS 8
extern uint64_t bt_readers[]; /* BT_READERS x {capstone handle, taken}, then the page below */
static int same_bytes(const uint8_t *a, const uint8_t *b, unsigned n);
cs_insn *bt_disassemble_at(const void *address);

/* Gum's function jumps through a page of the agent's that is never freed: a magic word,
   the target (this module's bt_disassemble_at, or Gum's own first instructions, copied
   there and followed by a jump back), the copy, and the jump through the target.  Putting
   Gum's own back is one store, never a rewrite of code another thread may be running; a
   forked child's script, whose copy of the parent's code holds the jump already, sets its
   own; a forked child's copy of this module, which Frida may unload, puts Gum's back if
   the target is still its own (bt_on_fork_leave). */
#define BT_READER_MAGIC 0x7264726d75677462ULL
#define BT_READER_TARGET 8
#define BT_READER_COPY 16
#define BT_READER_JUMP 48
static const uint8_t reader_jump[6] = {0xff, 0x25, 0, 0, 0, 0}; /* jmp [rip] */

static uint8_t *reader_page_of(const uint8_t *start) {
  uint64_t to, magic;
  if (!same_bytes(start, reader_jump, 6) || !read_safely(start + 6, &to, 8) ||
      !read_safely((const void *)(to - BT_READER_JUMP), &magic, 8) || magic != BT_READER_MAGIC)
    return NULL;
  return (uint8_t *)(to - BT_READER_JUMP);
}

/* Where the page is asked for: a forked child's script finds it there (bt_gum_reader_inherited)
   without looking through Frida's 20 MB of code again (15 ms, while Frida holds the child
   and the parent waits in its fork()). */
static uint64_t reader_hint(void) {
  return ((uint64_t)cs_open & ~0xfffffULL) - (1ULL << 32);
}

/* Gum's function a recording of the parent process pointed to its page, or NULL. */
void *bt_gum_reader_inherited(void) {
  uint8_t *page = (uint8_t *)reader_hint();
  uint64_t magic, back;
  if (!read_safely(page, &magic, 8) || magic != BT_READER_MAGIC ||
      !read_safely(page + BT_READER_COPY + 20, &back, 8))
    return NULL;
  uint8_t *start = (uint8_t *)(back - 14);
  return reader_page_of(start) == page ? start : NULL;
}

/* Points Gum's function at `start` to bt_disassemble_at: 1 when the caller is to write the
   14 bytes of `patch` over its start, 0 when it jumps through the page already, -1 when
   its first 14 bytes are not whole instructions that can run elsewhere. */
int bt_gum_reader_install(const uint8_t *start, uint8_t *patch) {
  uint8_t *page = reader_page_of(start);
  if (page != NULL) {
    bt_readers[2 * BT_READERS] = (uint64_t)page;
    *(uint64_t *)(page + BT_READER_TARGET) = (uint64_t)bt_disassemble_at;
    return 0;
  }
  csh cs;
  if (cs_open(CS_ARCH_X86, CS_MODE_64, &cs) != CS_ERR_OK)
    return -1;
  cs_option(cs, CS_OPT_DETAIL, CS_OPT_ON);
  cs_insn *insn = cs_malloc(cs);
  const uint8_t *code = start;
  size_t left = 14;
  uint64_t address = (uint64_t)start;
  int movable = insn != NULL;
  while (movable && left > 0 && cs_disasm_iter(cs, &code, &left, &address, insn)) {
    const cs_x86 *x = &insn->detail->x86;
    for (int g = 0; g < insn->detail->groups_count; g++) {
      uint8_t group = insn->detail->groups[g];
      movable &= group != CS_GRP_JUMP && group != CS_GRP_CALL && group != CS_GRP_RET &&
                 group != CS_GRP_INT && group != CS_GRP_IRET && group != CS_GRP_BRANCH_RELATIVE;
    }
    for (int i = 0; i < x->op_count; i++)
      movable &= !(x->operands[i].type == X86_OP_MEM && x->operands[i].mem.base == X86_REG_RIP);
  }
  movable &= left == 0 && address == (uint64_t)start + 14;
  if (insn != NULL)
    cs_free(insn, 1);
  cs_close(&cs);
  if (!movable)
    return -1;
  page = mmap((void *)reader_hint(), 4096, 7 /* RWX */,
              0x22 | 0x100000 /* PRIVATE|ANONYMOUS|FIXED_NOREPLACE */, -1, 0);
  if (page == (uint8_t *)-1)
    page = mmap(NULL, 4096, 7, 0x22, -1, 0);
  if (page == (uint8_t *)-1)
    return -1;
  *(uint64_t *)page = BT_READER_MAGIC;
  for (int i = 0; i < 14; i++)
    page[BT_READER_COPY + i] = start[i];
  for (int i = 0; i < 6; i++)
    page[BT_READER_COPY + 14 + i] = reader_jump[i];
  *(uint64_t *)(page + BT_READER_COPY + 20) = (uint64_t)start + 14;
  static const uint8_t through_target[6] = {0xff, 0x25, /* jmp [rip - 46]: the target */
                                            (uint8_t)(BT_READER_TARGET - BT_READER_JUMP - 6),
                                            0xff, 0xff, 0xff};
  for (int i = 0; i < 6; i++)
    page[BT_READER_JUMP + i] = through_target[i];
  *(uint64_t *)(page + BT_READER_TARGET) = (uint64_t)bt_disassemble_at;
  bt_readers[2 * BT_READERS] = (uint64_t)page;
  for (int i = 0; i < 6; i++)
    patch[i] = reader_jump[i];
  *(uint64_t *)(patch + 6) = (uint64_t)(page + BT_READER_JUMP);
  return 1;
}

/* Gum's own function back, if the page still points here (the end of the recording; the
   child's side of a fork()). */
void bt_gum_reader_restore(void) {
  uint8_t *page = (uint8_t *)bt_readers[2 * BT_READERS];
  if (page == NULL)
    return;
  uint64_t *target = (uint64_t *)(page + BT_READER_TARGET);
  if (*target == (uint64_t)bt_disassemble_at)
    *target = (uint64_t)(page + BT_READER_COPY);
}

cs_insn *bt_disassemble_at(const void *address) {
  cs_insn *insn = NULL;
  for (int k = 0; k < BT_READERS; k++) {
    int *taken = (int *)&bt_readers[2 * k + 1];
    if (*taken || swap_int(taken, 0, 1) != 0)
      continue;
    csh *cs = (csh *)&bt_readers[2 * k];
    if (*cs == 0 && cs_open(CS_ARCH_X86, CS_MODE_64, cs) == CS_ERR_OK)
      cs_option(*cs, CS_OPT_DETAIL, CS_OPT_ON);
    if (*cs != 0)
      cs_disasm(*cs, address, 16, (uint64_t)address, 1, &insn);
    bt_barrier();
    *taken = 0;
    if (*cs != 0)
      return insn;
    break;
  }
  csh own;
  if (cs_open(CS_ARCH_X86, CS_MODE_64, &own) != CS_ERR_OK)
    return NULL;
  cs_option(own, CS_OPT_DETAIL, CS_OPT_ON);
  cs_disasm(own, address, 16, (uint64_t)address, 1, &insn);
  cs_close(&own);
  return insn;
}

/* Where Gum's capstone is, for the script to look for that function near it. */
void *bt_cs_open(void) {
  return (void *)cs_open;
}

static uint64_t call_target(const uint8_t *call) {
  return call[0] == 0xe8 ? (uint64_t)(call + 5) + (int64_t) * (const int32_t *)(call + 1) : 0;
}

/* Gum's function, found from a match of its call of cs_open(handle, CS_ARCH_X86, CS_MODE_64)
   (`mov esi, 8; mov edi, 3; call cs_open`): followed by calls of cs_option(), cs_disasm()
   and cs_close() in that order and a `ret`, and begun right after the function before it
   (its `ret` or padding) with straight-line code up to the match.  NULL when the code
   there is not that. */
void *bt_gum_reader_at(const uint8_t *match) {
  static const uint8_t head[10] = {0xbe, 8, 0, 0, 0, 0xbf, 3, 0, 0, 0};
  if (!same_bytes(match, head, 10) || call_target(match + 10) != (uint64_t)cs_open)
    return NULL;
  const uint64_t then[3] = {(uint64_t)cs_option, (uint64_t)cs_disasm, (uint64_t)cs_close};
  const uint8_t *p = match + 15, *end = match + 15 + 96;
  int found = 0;
  while (p < end && found < 3) {
    if (call_target(p) == then[found]) {
      found++;
      p += 5;
    } else {
      p++;
    }
  }
  int returns = 0;
  for (const uint8_t *q = p; found == 3 && q < p + 24 && !returns; q++)
    returns = *q == 0xc3;
  if (!returns)
    return NULL;
  csh cs;
  if (cs_open(CS_ARCH_X86, CS_MODE_64, &cs) != CS_ERR_OK)
    return NULL;
  cs_insn *insn = cs_malloc(cs);
  const uint8_t *start = NULL;
  for (const uint8_t *s = match - 1; insn != NULL && start == NULL && s > match - 64; s--) {
    if (s[-1] != 0xc3 && s[-1] != 0xcc && s[-1] != 0x90)
      continue;
    int patched = reader_page_of(s) != NULL; /* by a recording of the parent process */
    const uint8_t *code = patched ? s + 14 : s;
    size_t left = (size_t)(match - code);
    uint64_t address = (uint64_t)code;
    int straight = s + 14 <= match || !patched, first = !patched;
    while (left > 0 && straight && cs_disasm_iter(cs, &code, &left, &address, insn)) {
      straight = insn->id != X86_INS_RET && insn->id != X86_INS_JMP &&
                 (!first || insn->id == X86_INS_PUSH) &&
                 !(insn->bytes[0] >= 0x70 && insn->bytes[0] <= 0x7f) && /* no jcc */
                 !(insn->bytes[0] == 0x0f && insn->bytes[1] >= 0x80 && insn->bytes[1] <= 0x8f);
      first = 0;
    }
    if (straight && left == 0 && address == (uint64_t)match)
      start = s;
  }
  if (insn != NULL)
    cs_free(insn, 1);
  cs_close(&cs);
  return (void *)start;
}

/* What the block starting at `code` leaves dead on entry: a mask of the general-purpose
   registers it overwrites before reading them, and whether it sets every status flag before
   testing one, both proven on the instructions that run in sequence from the start (up to
   the first transfer or possibly faulting access).  A register or the flags found dead may
   be used by the record sequence without being saved. */
static uint32_t dead_state(BtThread *t, csh cs, uint64_t code, int *flags_dead) {
  *flags_dead = 0;
  /* `cs` is Stalker's own decoder for this thread (its relocator's, with details), used on
     this thread between its uses.  A decoder of our own per thread cost a cs_open(), which
     builds capstone's instruction table (60 KB, 15,000 entries), and kept it for as long
     as the thread lived.  capstone allocates from Gum's own heap (gum.c registers it), never
     libc's malloc, so this is safe whatever the thread was running when the block was
     compiled. */
  if (t->cs_insn == NULL && (t->cs_insn = cs_malloc(cs)) == NULL)
    return 0;
  /* the block's own page is mapped (Stalker just read it); beyond it, only what can be read */
  uint8_t buf[192];
  uint64_t room = 4096 - (code & 4095);
  uint64_t n = room < sizeof buf ? room : sizeof buf;
  for (uint64_t i = 0; i < n; i++)
    buf[i] = ((const uint8_t *)code)[i];
  if (n < sizeof buf && read_safely((const void *)(code + n), buf + n, sizeof buf - n))
    n = sizeof buf;
  const uint8_t *p = buf;
  size_t left = n;
  uint64_t address = code;
  uint32_t used = 0, dead = 0;
  int flags_known = 0;
  for (int k = 0; k < 32 && cs_disasm_iter(cs, &p, &left, &address, t->cs_insn); k++) {
    const cs_insn *insn = t->cs_insn;
    if (insn->detail == NULL) /* a decoder without details: nothing proven */
      break;
    const cs_x86 *x = &insn->detail->x86;
    cs_regs rd, wr;
    uint8_t nrd = 0, nwr = 0;
    if (cs_regs_access(cs, insn, rd, &nrd, wr, &nwr) != 0)
      break;
    /* xor/sub of a register with itself only writes it */
    int idiom = (insn->id == X86_INS_XOR || insn->id == X86_INS_SUB) && x->op_count == 2 &&
                x->operands[0].type == X86_OP_REG && x->operands[1].type == X86_OP_REG &&
                x->operands[0].reg == x->operands[1].reg;
    int full;
    for (int i = 0; i < nrd; i++) {
      int r = gpr_of(rd[i], &full);
      if (r >= 0 && !idiom)
        used |= 1u << r;
      if (rd[i] == X86_REG_EFLAGS)
        flags_known = 1;
    }
    if (x->eflags & STATUS_FLAGS_TESTED)
      flags_known = 1;
    if (ends_lookahead(cs, insn))
      break;
    /* Only these define their destination outright.  Capstone lists the destination of
       cmov, bsf or cmpxchg as written only, though each may keep the old value. */
    int defines = idiom;
    switch (insn->id) {
    case X86_INS_MOV: case X86_INS_MOVABS: case X86_INS_MOVZX: case X86_INS_MOVSX:
    case X86_INS_MOVSXD: case X86_INS_LEA: case X86_INS_POP: case X86_INS_MOVQ:
    case X86_INS_MOVD:
      defines = 1;
    }
    for (int i = 0; i < nwr; i++) {
      int r = gpr_of(wr[i], &full);
      if (r < 0 || (used & (1u << r)))
        continue;
      if (full && defines)
        dead |= 1u << r;
      else
        used |= 1u << r; /* a partial or conditional write keeps the old value */
    }
    if (!flags_known) {
      switch (insn->id) {
      case X86_INS_ADD: case X86_INS_SUB: case X86_INS_CMP: case X86_INS_NEG:
      case X86_INS_AND: case X86_INS_OR: case X86_INS_XOR: case X86_INS_TEST:
        *flags_dead = 1;
        flags_known = 1;
      }
    }
  }
  return dead & ~(1u << 4 /* rsp */);
}

/* x86-64 encodings of the record sequences' instructions for register r (0..15): written
   into `b`, returning the length.  The emitters below and finish_interrupted_record(),
   which must recognise exactly what was emitted, both use them. */
static uint8_t rex_w(int reg, int base) { return 0x48 | ((reg >> 3) << 2) | (base >> 3); }

static unsigned enc_modrm_disp8(uint8_t *b, int reg, int base, uint8_t disp) {
  unsigned n = 0;
  b[n++] = (uint8_t)(0x40 | ((reg & 7) << 3) | (base & 7));
  if ((base & 7) == 4)
    b[n++] = 0x24; /* rsp/r12 need a SIB byte */
  b[n++] = disp;
  return n;
}

/* mov r, [address] (0x8b) or mov [address], r (0x89), a 32-bit absolute address */
static unsigned enc_mov_reg_abs(uint8_t *b, uint8_t opcode, int r, uint32_t address) {
  b[0] = rex_w(r, 0);
  b[1] = opcode;
  b[2] = (uint8_t)(0x04 | ((r & 7) << 3));
  b[3] = 0x25;
  for (int i = 0; i < 4; i++)
    b[4 + i] = (uint8_t)(address >> (8 * i));
  return 8;
}

/* movabs rax, [address] (0xa1) or movabs [address], rax (0xa3) */
static unsigned enc_movabs(uint8_t *b, uint8_t opcode, const void *address) {
  b[0] = 0x48;
  b[1] = opcode;
  for (int i = 0; i < 8; i++)
    b[2 + i] = (uint8_t)((uint64_t)address >> (8 * i));
  return 10;
}

/* mov qword [r-4], imm32, without its imm32 */
static unsigned enc_slot_store(uint8_t *b, int r) {
  b[0] = (uint8_t)(0x48 | (r >> 3));
  b[1] = 0xc7;
  return 2 + enc_modrm_disp8(b + 2, 0, r, (uint8_t)-SLOT_LEAD);
}

/* lea r, [r+4] */
static unsigned enc_lea(uint8_t *b, int r) {
  b[0] = rex_w(r, r);
  b[1] = 0x8d;
  return 2 + enc_modrm_disp8(b + 2, r, r, SLOT_LEAD);
}

static void put_mov_reg_abs(GumX86Writer *cw, uint8_t opcode, int r, uint32_t address) {
  uint8_t b[8];
  put_bytes(cw, b, enc_mov_reg_abs(b, opcode, r, address));
}

static void put_movabs(GumX86Writer *cw, uint8_t opcode, const void *address) {
  uint8_t b[10];
  put_bytes(cw, b, enc_movabs(b, opcode, address));
}

/* mov qword [r-4], imm32 (the slot's block id, and the zero of the slot after it):
   returns where the immediate is, to patch the id in once it is known */
static uint32_t *put_store_slot(GumX86Writer *cw, int r) {
  uint8_t b[5];
  put_bytes(cw, b, enc_slot_store(b, r));
  uint32_t *imm = (uint32_t *)gum_x86_writer_cur(cw);
  uint32_t zero = 0;
  put_bytes(cw, (uint8_t *)&zero, 4);
  return imm;
}

static const uint8_t movzx_ecx_cx_jrcxz[] = {0x0f, 0xb7, 0xc9, 0xe3, 0x05};
static const uint8_t movzx_ecx_ax_jrcxz[] = {0x0f, 0xb7, 0xc8, 0xe3, 0x05};
static const uint8_t movabs_load = 0xa1, movabs_store = 0xa3;
static const uint8_t mov_rax_rcx[] = {0x48, 0x89, 0xc8}, mov_rcx_rax[] = {0x48, 0x89, 0xc1};

/* test r16, r16 */
static void put_test16(GumX86Writer *cw, int r) {
  uint8_t test[3] = {0x66, 0x45 /* REX.RB */, 0x85};
  uint8_t modrm = (uint8_t)(0xc0 | ((r & 7) << 3) | (r & 7));
  put_bytes(cw, test, 1);
  put_bytes(cw, test + (r < 8 ? 2 : 1), r < 8 ? 1 : 2); /* REX only for r8..r15 */
  put_bytes(cw, &modrm, 1);
}

/* The block leaves Stalker (on_chunk_end): the program's registers back as they were at
   the block's start, where nothing of the block has run yet, then
     jmp [rip]; dq start
   which needs no register.  `saved`: rax (1), and rcx too (2), are in the thread's slots. */
static void put_leave(GumX86Writer *cw, BtThread *t, int saved, uint64_t start) {
  if (saved == 2) {
    put_movabs(cw, movabs_load, &t->saved_rcx);
    put_bytes(cw, mov_rcx_rax, 3);
  }
  if (saved >= 1)
    put_movabs(cw, movabs_load, &t->saved_rax);
  static const uint8_t jmp_rip[] = {0xff, 0x25, 0, 0, 0, 0};
  put_bytes(cw, jmp_rip, sizeof jmp_rip);
  put_bytes(cw, (const uint8_t *)&start, 8);
}

/* Gum's epilogs (17.26) undo part of what its prologs keep on an AVX-512 machine: they
   put back the upper 256 bits of zmm0-15 (vinserti64x4), then the upper 128 of ymm0-15
   with vinserti128, a VEX write that zeroes bits 256-511 again.  Every callout and every
   block Gum compiled or looked up for a thread so changed the program's vector state:
   glibc's strstr() (its AVX-512 version keeps the needle's first byte across its loop)
   missed matches in new threads and forked children (32 of 96 of `avx512 threads 96`,
   blocks compiled afresh), and `fork rings` in CI took its own ring for its parent's.
   Each epilog helper a thread's callouts call is mended in place: its 16 vinserti128
   become EVEX vinserti32x4 of the whole zmm registers, which write bits 128-255 alone.
   Only where the bytes are exactly Gum's (another Gum is left as it is), and only by the
   thread whose context the helpers belong to, from its transform, between its prolog and
   its epilog: no thread runs them meanwhile. */
#define BT_EPILOG_VECTORS 174 /* the bytes checked: from the last vinserti64x4 */
#define BT_EPILOG_YMM_AT 16   /* the 16 vinserti128, 151 bytes, after it and `add rsp, 0x200` */
#define BT_EPILOG_YMM_SIZE 151

static int write_safely(void *addr, const void *in, uint64_t n) {
  uint64_t local[2] = {(uint64_t)in, n};
  uint64_t remote[2] = {(uint64_t)addr, n};
  return syscall(311 /* process_vm_writev */, getpid(), local, 1, remote, 1, 0) == (long)n;
}

/* vinserti128 $1, 16*i(%rsp), %ymm<i>, %ymm<i>, as Gum writes it, or (whole: 1) EVEX
   vinserti32x4 $1, 16*i(%rsp), %zmm<i>, %zmm<i>; returns its length. */
static unsigned enc_ymm_restore(uint8_t *out, unsigned i, int whole) {
  unsigned n = 0;
  out[n++] = whole ? 0x62 : 0xc4;
  out[n++] = (i < 8 ? 0xe3 : 0x63) | (whole ? 0x10 : 0); /* R (and EVEX's R'), map 0f3a */
  out[n++] = (uint8_t)(((~i & 15) << 3) | 0x05);          /* vvvv = i, 256-bit, 66 */
  if (whole)
    out[n++] = 0x48; /* 512-bit */
  out[n++] = 0x38;
  unsigned disp = whole ? i : 16 * i; /* EVEX scales an 8-bit displacement by 16 */
  unsigned mod = disp == 0 ? 0 : disp < 128 ? 1 : 2;
  out[n++] = (uint8_t)((mod << 6) | ((i & 7) << 3) | 4);
  out[n++] = 0x24; /* [rsp + disp] */
  for (unsigned k = 0; k < (mod == 1 ? 1u : mod == 2 ? 4u : 0u); k++)
    out[n++] = (uint8_t)(disp >> (8 * k));
  out[n++] = 0x01;
  return n;
}

/* The bytes of Gum's that are mended (mend = 0), or what replaces the vinserti128 (1). */
static unsigned epilog_vectors(uint8_t *out, int mend) {
  static const uint8_t before[] = {
      0x62, 0x73, 0x85, 0x48, 0x3a, 0x7c, 0x24, 0x0f, 0x01, /* vinserti64x4 $1, 0x1e0(%rsp),
                                                                %zmm15, %zmm15 */
      0x48, 0x81, 0xc4, 0x00, 0x02, 0x00, 0x00,             /* add rsp, 0x200 */
  };
  static const uint8_t after[] = {0x48, 0x81, 0xc4, 0x00, 0x01, 0x00, 0x00}; /* add rsp, 0x100 */
  unsigned n = 0;
  if (!mend)
    for (unsigned k = 0; k < sizeof before; k++)
      out[n++] = before[k];
  for (unsigned i = 0; i < 16; i++)
    n += enc_ymm_restore(out + n, i, mend);
  if (mend) {
    static const uint8_t nop8[] = {0x0f, 0x1f, 0x84, 0x00, 0x00, 0x00, 0x00, 0x00};
    for (unsigned k = 0; k < sizeof nop8 && n < BT_EPILOG_YMM_SIZE; k++)
      out[n++] = nop8[k];
  } else {
    for (unsigned k = 0; k < sizeof after; k++)
      out[n++] = after[k];
  }
  return n;
}

/* Mends every epilog of Gum's found in [from, from + size) (see above), read in steps
   (the stack may be a goroutine's, and the module's data is not writable). */
#define BT_EPILOG_STEP 256
static int same_bytes(const uint8_t *a, const uint8_t *b, unsigned n);

static void mend_epilogs_in(uint64_t from, unsigned size) {
  uint8_t window[BT_EPILOG_STEP + BT_EPILOG_VECTORS];
  uint8_t gums[BT_EPILOG_VECTORS], mended[BT_EPILOG_YMM_SIZE];
  if (epilog_vectors(gums, 0) != BT_EPILOG_VECTORS ||
      epilog_vectors(mended, 1) != BT_EPILOG_YMM_SIZE)
    return;
  for (unsigned step = 0; step < size; step += BT_EPILOG_STEP) {
    if (!read_safely((void *)(from + step), window, sizeof window))
      continue; /* (not mapped: the slab's start) */
    for (unsigned at = 0; at < BT_EPILOG_STEP; at++)
      if (window[at] == gums[0] && same_bytes(window + at, gums, BT_EPILOG_VECTORS))
        write_safely((void *)(from + step + at + BT_EPILOG_YMM_AT), mended, BT_EPILOG_YMM_SIZE);
  }
}

static void put_callout(GumStalkerIterator *iterator, GumX86Writer *cw, BtThread *t,
                        GumStalkerCallout callout, gpointer data) {
  gum_stalker_iterator_put_callout(iterator, callout, data, NULL);
  /* Gum's callout ends: call <epilog>; mov rsp, [rip + ...] (back to the thread's stack) */
  const uint8_t *end = cw->code;
  if (end[-12] != 0xe8 || end[-7] != 0x48 || end[-6] != 0x8b || end[-5] != 0x25)
    return;
  uint64_t epilog = cw->pc - 7 + (uint64_t)(int64_t) * (const int32_t *)(end - 11);
  if (epilog == t->epilog_seen)
    return;
  t->epilog_seen = epilog;
  /* the full epilog, and the minimal one Gum writes with it, two helpers before it */
  mend_epilogs_in(epilog - 0x800, 0xc00);
}

/* After the chunk check's jrcxz (which skips 5 bytes): a jmp over the callout that claims
   the next chunk, and after the callout the same check again on `wp`, reloaded (the callout
   gives rcx back as it was): at a chunk's end still, the block leaves (put_leave).  The
   flags are live and rcx is dead (or saved: `saving`).  `label` is any address unique to
   this block. */
static void put_inline_slow_path(GumStalkerIterator *iterator, GumX86Writer *cw, BtThread *t,
                                 gconstpointer label, int saving, uint64_t start) {
  gum_x86_writer_put_jmp_near_label(cw, label);
  put_callout(iterator, cw, t, on_chunk_end, t);
  if (saving) {
    put_movabs(cw, movabs_load, t->wpp);
    put_bytes(cw, movzx_ecx_ax_jrcxz, 5);
  } else {
    put_mov_reg_abs(cw, 0x8b, 1 /* rcx */, (uint32_t)(uint64_t)t->wpp);
    put_bytes(cw, movzx_ecx_cx_jrcxz, 5);
  }
  gum_x86_writer_put_jmp_near_label(cw, label);
  put_leave(cw, t, saving ? 2 : 0, start);
  gum_x86_writer_put_label(cw, label);
}

/* The chunk check of a block whose flags are dead: `jz` to the block's tail, where
   put_tail_slow_path() puts the callout after the block's last instruction, so the common
   path runs straight on instead of jumping over an inline callout's ~100 bytes (fib(35)
   inside the program: 0.061 -> 0.057 s; the call loop unchanged).  The labels are
   addresses unique to this block: `id` (back here) and `id + 1` (the tail). */
static void put_jz_to_tail(GumX86Writer *cw, uint32_t *id) {
  gum_x86_writer_put_jcc_near_label(cw, X86_INS_JE, (uint8_t *)id + 1, GUM_NO_HINT);
  gum_x86_writer_put_label(cw, id);
}

/* After the block's last instruction.  Stalker's virtualized branch never falls through to
   here, but a block Stalker ends early (its size limit) continues with the jmp Stalker
   writes after this, so the tail starts by jumping there.  After the callout, `wp` is
   tested again, through register r (dead) or rax (saved: r < 0), and the flags (dead):
   at a chunk's end still, the block leaves (put_leave). */
static void put_tail_slow_path(GumStalkerIterator *iterator, GumX86Writer *cw, BtThread *t,
                               uint32_t *id, int r, uint64_t start) {
  gum_x86_writer_put_jmp_near_label(cw, (uint8_t *)id + 2);
  gum_x86_writer_put_label(cw, (uint8_t *)id + 1);
  put_callout(iterator, cw, t, on_chunk_end, t);
  if (r >= 0) {
    put_mov_reg_abs(cw, 0x8b, r, (uint32_t)(uint64_t)t->wpp);
    put_test16(cw, r);
  } else {
    put_movabs(cw, movabs_load, t->wpp);
    put_test16(cw, 0 /* rax */);
  }
  gum_x86_writer_put_jcc_near_label(cw, X86_INS_JNE, id, GUM_NO_HINT);
  put_leave(cw, t, r >= 0 ? 0 : 1, start);
  gum_x86_writer_put_label(cw, (uint8_t *)id + 2);
}

/* The record sequence that needs no saving: register r is dead at the start of the block;
   the chunk check is test/jz when the flags are dead too, else r is rcx and it is jrcxz:
     mov r, [wp]; mov qword [r-4], ID; lea r, [r+4]; mov [wp], r
     movzx ecx, cx; jrcxz slow       or       test r16, r16; jz tail
   Returns where the id goes. */
/* Where a record sequence is at each of its steps (BtCopy's read_at ... restore_at), as
   addresses in the copy. */
typedef struct {
  uint64_t read, written, check_end, restore;
} BtRecordAt;

static uint32_t *put_short_record(GumStalkerIterator *iterator, GumX86Writer *cw, BtThread *t,
                                  int r, int flags_dead, uint64_t start, BtRecordAt *at) {
  uint32_t wp32 = (uint32_t)(uint64_t)t->wpp;
  at->read = cw->pc;
  put_mov_reg_abs(cw, 0x8b, r, wp32);
  uint32_t *id = put_store_slot(cw, r);
  uint8_t lea[5];
  put_bytes(cw, lea, enc_lea(lea, r));
  put_mov_reg_abs(cw, 0x89, r, wp32);
  at->written = cw->pc;
  if (!flags_dead) { /* r is rcx */
    put_bytes(cw, movzx_ecx_cx_jrcxz, 5);
    at->check_end = cw->pc + 5; /* and the slow path's jmp over its callout */
    put_inline_slow_path(iterator, cw, t, id, 0, start);
  } else {
    put_test16(cw, r);
    put_jz_to_tail(cw, id);
    at->check_end = cw->pc;
  }
  at->restore = cw->pc;
  return id;
}

/* The record sequence of a block with no dead register (see the top of this file).
   Returns where the id goes. */
static uint32_t *put_saving_record(GumStalkerIterator *iterator, GumX86Writer *cw, BtThread *t,
                                   int flags_dead, uint64_t start, BtRecordAt *at) {
  put_movabs(cw, movabs_store, &t->saved_rax);
  if (!flags_dead) {
    put_bytes(cw, mov_rax_rcx, 3);
    put_movabs(cw, movabs_store, &t->saved_rcx);
  }
  at->read = cw->pc;
  put_movabs(cw, movabs_load, t->wpp);
  uint32_t *id = put_store_slot(cw, 0 /* rax */);
  gum_x86_writer_put_lea_reg_reg_offset(cw, GUM_X86_RAX, GUM_X86_RAX, SLOT_LEAD);
  put_movabs(cw, movabs_store, t->wpp);
  at->written = cw->pc;
  if (flags_dead) {
    put_test16(cw, 0 /* rax */);
    put_jz_to_tail(cw, id);
    at->check_end = cw->pc;
  } else {
    put_bytes(cw, movzx_ecx_ax_jrcxz, 5); /* over the 5-byte jmp of the slow path */
    at->check_end = cw->pc + 5;
    put_inline_slow_path(iterator, cw, t, id, 1, start);
  }
  at->restore = cw->pc;
  if (!flags_dead) {
    put_movabs(cw, movabs_load, &t->saved_rcx);
    put_bytes(cw, mov_rcx_rax, 3);
  }
  put_movabs(cw, movabs_load, &t->saved_rax);
  return id;
}

/* The ucontext's general registers (uc_mcontext.gregs) by x86 register number, and rip. */
static const uint8_t greg_of[16] = {13, 14, 12, 11, 15, 10, 9, 8, 0, 1, 2, 3, 4, 5, 6, 7};
#define GREG_RIP 16

/* (CModule links no memcmp) */
static int same_bytes(const uint8_t *a, const uint8_t *b, unsigned n) {
  for (unsigned i = 0; i < n; i++)
    if (a[i] != b[i])
      return 0;
  return 1;
}

/* The length of the instruction of the sequence with register r found at `code`, or 0. */
static unsigned match_slot_store(const uint8_t *code, int r) {
  uint8_t b[5];
  unsigned n = enc_slot_store(b, r);
  return same_bytes(code, b, n) ? n + 4 : 0;
}

static unsigned match_lea(const uint8_t *code, int r) {
  uint8_t b[5];
  unsigned n = enc_lea(b, r);
  if (same_bytes(code, b, n))
    return n;
  /* put_saving_record() has Gum encode it, with a 32-bit displacement */
  static const uint8_t gum_lea_rax[7] = {0x48, 0x8d, 0x80, SLOT_LEAD, 0, 0, 0};
  return r == 0 && same_bytes(code, gum_lea_rax, 7) ? 7 : 0;
}

static unsigned match_wp_store(const uint8_t *code, int r, BtThread *t) {
  uint8_t b[10];
  unsigned n = enc_mov_reg_abs(b, 0x89, r, (uint32_t)(uint64_t)t->wpp);
  if (same_bytes(code, b, n))
    return n;
  n = enc_movabs(b, 0xa3, t->wpp);
  return r == 0 && same_bytes(code, b, n) ? n : 0;
}

/* Two signals pending as the thread goes back to user space are delivered at once: the
   kernel sets up the first one's frame (the code it interrupted), then the second one's on
   top of it, whose pc is the first one's handler -- the signal stub -- before a single
   instruction of it ran.  The code the thread was in is then the first frame's, found
   from the second's stack pointer: the first handler's return address (the restorer),
   then that frame's ucontext.  Without this a record sequence the first signal
   interrupted was left unfinished while the second one's GAP was written: the sequence
   went on with the old pointer, over the GAP, and the thread's records read a block that
   never ran (SIGALRM and SIGUSR1 at 4 threads: 1 to 9 branches out of place a run).  So
   does a signal that comes before the stub has called bt_signal_enter (its first
   instructions, which push this much: sigStub in stalker_agent.js); one that comes inside
   bt_signal_enter before it has finished the sequence: frame_of_stub_call(). */
static int stub_pushed(uint64_t offset) {
  switch (offset) {
  case 0: return 0;   /* sub rsp, 16 */
  case 4: return 16;  /* push rdi */
  case 5: return 24;  /* push rsi */
  case 6: return 32;  /* push rdx */
  case 7: case 12: case 19: case 22: case 24: return 40; /* lea, mov, test, jz, call */
  default: return -1;
  }
}

/* `*kernels`: whether `uc` is a frame the kernel wrote (the stub's), which is read as it
   is: read safely, each read is a system call (process_vm_readv: 1.4 us, 5.4 us with three
   other threads busy, on this kind of VM), and a delivery made 7 or more of them.  A frame
   from elsewhere (a handler's third argument, which a handler called as a function does
   not get) is read safely, as is the stack under any.  One found under it is the kernel's. */
static uint8_t *interrupted_frame(uint8_t *uc, int *kernels) {
  for (int depth = 0; uc != NULL && depth < BT_HANDLER_DEPTH; depth++) {
    uint64_t rip, rsp, pretcode;
    int pushed;
    if (*kernels) {
      rip = *(const uint64_t *)(uc + UC_RIP);
      rsp = *(const uint64_t *)(uc + UC_RIP - 8);
    } else if (!read_safely(uc + UC_RIP, &rip, 8) || !read_safely(uc + UC_RIP - 8, &rsp, 8)) {
      return uc;
    }
    if (rip - (uint64_t)bt_sigstub > 24 || (pushed = stub_pushed(rip - (uint64_t)bt_sigstub)) < 0 ||
        !read_safely((void *)(rsp + pushed), &pretcode, 8) || pretcode != bt_fault_restorer())
      return uc;
    uc = (uint8_t *)(rsp + pushed + 8);
    *kernels = 1;
  }
  return uc;
}

/* A second signal that comes while bt_signal_enter runs for the first, before it has
   finished the sequence the first one interrupted (in its C code, or in libc's syscall()
   for the thread's id): the first frame is found from the stub's call, whose return
   address is on the stack a little above the second frame's (read for 512 bytes).
   Without it the second signal's GAP went where the sequence then wrote its slot, and the
   thread's trace held more records than were counted: `twosignals` at 2,000,000 rounds, 5
   runs of 30 off by 4 to 24 records in one to three threads (18 such signals seen), against
   0 of 30 with the frame finished (8 seen).  A value there by chance (a stale return address
   in a program's uninitialised local) leads to a frame whose registers do not hold `wp`,
   which finish_record_in then leaves alone. */
#define BT_SIGSTUB_CALLED 26 /* the stub's return address from bt_signal_enter */
static uint8_t *frame_of_stub_call(const uint8_t *uc, int kernels) {
  uint64_t rsp, words[64], pretcode;
  if (uc == NULL)
    return NULL;
  if (kernels)
    rsp = *(const uint64_t *)(uc + UC_RIP - 8);
  else if (!read_safely(uc + UC_RIP - 8, &rsp, 8))
    return NULL;
  if ((rsp & 7) != 0)
    return NULL;
  uint64_t n = 4096 - (rsp & 4095); /* the next page may not be mapped */
  if (n > sizeof words)
    n = sizeof words;
  if (!read_safely((const void *)rsp, words, n))
    return NULL;
  if (n < sizeof words && read_safely((const void *)(rsp + n), (uint8_t *)words + n,
                                      sizeof words - n))
    n = sizeof words;
  for (unsigned k = 0; k < n / 8; k++) {
    if (words[k] != (uint64_t)bt_sigstub + BT_SIGSTUB_CALLED)
      continue;
    uint64_t frame = rsp + 8 * k + 8 + stub_pushed(BT_SIGSTUB_CALLED - 2);
    if (read_safely((const void *)frame, &pretcode, 8) && pretcode == bt_fault_restorer())
      return (uint8_t *)(frame + 8);
    return NULL;
  }
  return NULL;
}

/* If the interrupted code is inside this thread's record sequence, between its read and
   its write of `wp`, do the rest of it on the signal frame: store the slot, move `wp`, and
   resume after the write (the chunk check that follows sees the moved pointer).  Returns 1
   when it did.  The frame is only written when the code there is the sequence and the
   register holds what the sequence would hold at that point. */
static int finish_record_in(BtThread *t, uint8_t *uc, int kernels);

/* `kernels` as for interrupted_frame. */
static int finish_interrupted_record(BtThread *t, uint8_t *uc, int kernels) {
  uc = interrupted_frame(uc, &kernels);
  return finish_record_in(t, uc, kernels) || finish_record_in(t, frame_of_stub_call(uc, kernels), 1);
}

static int finish_record_in(BtThread *t, uint8_t *uc, int kernels) {
  uint64_t gregs[17];
  uint8_t code[32] = {0}; /* the longest sequence tail is 26 bytes */
  if (uc == NULL)
    return 0;
  if (kernels)
    for (int i = 0; i < 17; i++)
      gregs[i] = ((const uint64_t *)(uc + 40))[i];
  else if (!read_safely(uc + 40, gregs, sizeof gregs))
    return 0;
  uint64_t rip = gregs[GREG_RIP];
  unsigned first = 4096 - (unsigned)(rip & 4095); /* the next page may not be mapped */
  if (first > sizeof code)
    first = sizeof code;
  int in_copies = 0; /* Stalker's slabs, which stay mapped and readable */
  for (const BtCopyChunk *c = t->copies; c != NULL && !in_copies; c = c->prev)
    in_copies = rip >= c->lo && rip < c->hi;
  if (in_copies)
    for (unsigned i = 0; i < first; i++)
      code[i] = ((const uint8_t *)rip)[i];
  else if (!read_safely((void *)rip, code, first))
    return 0;
  if (first < sizeof code)
    read_safely((void *)(rip + first), code + first, sizeof code - first);
  uint64_t wp = WP(t);
  for (int r = 0; r < 16; r++) {
    if (r == 4 /* rsp */)
      continue;
    uint64_t value = gregs[greg_of[r]];
    unsigned slot = match_slot_store(code, r), lea, store;
    if (slot && value == wp && (lea = match_lea(code + slot, r))
        && (store = match_wp_store(code + slot + lea, r, t))) {
      int32_t id = *(const int32_t *)(code + slot - 4);
      *(uint64_t *)(value - SLOT_LEAD) = (uint64_t)(int64_t)id;
    } else if (value == wp && (lea = match_lea(code, r))
               && (store = match_wp_store(code + lea, r, t))) {
      slot = 0;
    } else if (value == wp + SLOT_LEAD && (store = match_wp_store(code, r, t))) {
      slot = lea = 0;
      value -= SLOT_LEAD;
    } else {
      continue;
    }
    value += SLOT_LEAD;
    WP(t) = value;
    *(uint64_t *)(uc + 40 + 8 * greg_of[r]) = value;
    *(uint64_t *)(uc + 40 + 8 * GREG_RIP) = rip + slot + lea + store;
    return 1;
  }
  return 0;
}

/* An escape record from the thread's C code, after the slots before it. */
static void write_escape(BtThread *t, const uint64_t *words, unsigned n) {
  if (t->closed)
    return;
  enter_c(t);
  if (!t->closed) {
    sync_head(t);
    write_counted(t, words, n);
    refill(t);
  }
  leave_c(t);
}

/* A BLOCK word written as a BLOCK_FAR record through bt_writer.h (a word of the ring holds
   slots, never a BLOCK word). */
static void write_block_far(BtThread *t, uint64_t record) {
  uint64_t far[2] = {bt_escape(BT_RECORDTYPE_BLOCK_FAR, 1, record >> BT_BLOCK_ADDR_BITS),
                     record & ((1ULL << BT_BLOCK_ADDR_BITS) - 1)};
  write_escape(t, far, 2);
}

/* A block of one instruction at `start` (stalker_agent.js, follow). */
void bt_thread_block(BtThread *t, uint64_t start) {
  write_block_far(t, start);
}

/* A block compiled once the thread's block table is full: a callout writes its record. */
static void on_spilled_block(GumCpuContext *cpu, gpointer user_data) {
  uint64_t *spilled = user_data;
  write_block_far((BtThread *)spilled[0], spilled[1]);
}

static uint64_t *new_spilled(BtThread *t) {
  if (t->spill_left == 0) {
    uint8_t *p = mmap(NULL, 65536, 3, 0x22 /* PRIVATE|ANONYMOUS */, -1, 0);
    if (p == (uint8_t *)-1)
      return NULL;
    t->spill = (uint64_t *)p;
    t->spill_left = 65536 / 16;
  }
  uint64_t *e = t->spill;
  t->spill += 2;
  t->spill_left--;
  e[0] = (uint64_t)t;
  return e;
}

/* Stalker keeps all of a thread's compiled code and its data within 32-bit reach of the
   thread's context (GumExecCtx) and never frees any of it while the thread is followed; a
   thread that had it compile some 2.1 million blocks (a JIT writing new code all the time)
   found nothing free near enough, and Gum wrote through the NULL it got (frida-gum#793).
   So after BT_CONTEXT_BLOCKS blocks of the program's compiled in one context the thread
   takes a fresh one: the next block compiled is replaced by a jump to the thread's refollow
   stub (natively, with the program's registers as they are at the block's start), where
   bt_on_refollow unfollows the thread -- Gum frees the old context and its code at once,
   as the thread runs none of it -- and follows it again, and the stub jumps to the block,
   which the fresh context compiles and records.  The block is recorded once, where it
   ran, and no branch is missed: nothing of the program's runs in between.  The stub is
   made by a callout the first time (Frida's hooks cannot be placed from a transform).
   A thread that has just created another keeps its context a while longer: the new thread
   starts in the old context's code, which jumps to the program's instruction after the
   system call through the context itself, and it may not have run yet (a renewal then,
   which frees both, killed 2 of 8 runs of `threads` renewing every 50 blocks). */
#define BT_CLONE_GRACE_NS 200000000L

static void on_clone(GumCpuContext *cpu, gpointer user_data) {
  ((BtThread *)user_data)->clone_ns = monotonic_ns();
}

static void on_renew_stub_needed(GumCpuContext *cpu, gpointer user_data) {
  BtThread *t = user_data;
  if (!t->closed)
    make_refollow_stub(t);
}

static void on_renewal(GumCpuContext *cpu, gpointer user_data) {
  const uint64_t *renewal = user_data;
  BtThread *t = (BtThread *)renewal[0];
  *(uint64_t *)(t->refollow + BT_REFOLLOW_TARGET) = renewal[1];
  t->renewing = 1;
}

/* The restorer's system call, reached under Stalker: a handler run in the thread's context
   returns.  When the frame still holds the program's own pc (not Stalker's copy, which
   bt_on_sigreturn put there for a handler it followed, nor the refollow stub), the signal
   had come while the thread ran natively and Stalker began following it inside the
   handler's run: attached while a handler ran, or Gum's helper stopping the thread right
   as the kernel had delivered a signal, its pc in the signal stub (under a 5 kHz timer,
   the main thread was not taken over in 4 attaches of 20).  rt_sigreturn would send the
   thread back there natively, out of Stalker for good, its trace ending with the handler
   though it runs on.  It goes through the refollow stub instead, followed again there. */
static void on_restorer_followed(GumCpuContext *cpu, gpointer user_data) {
  BtThread *t = user_data;
  if (in_forked_child() || t->closed || t->leaving)
    return;
  /* as at the restorer's entry (bt_on_sigreturn): the stack pointer is at the ucontext.
     Only a pc in one of the program's modules: never a Stalker copy (a handler followed,
     put back by bt_on_sigreturn), the refollow stub or Frida's code; JIT code is left as
     before. */
  uint64_t *rip = (uint64_t *)(cpu->rsp + UC_RIP);
  const BtCodeRange *range = code_range(*rip);
  if (range == NULL || range->fridas)
    return;
  refollow_at_return(t, rip);
}

static int put_renewal(GumStalkerIterator *iterator, GumX86Writer *cw, BtThread *t,
                       uint64_t start) {
  if (t->closed || t->leaving || t->handlers_running > 0 ||
      (t->clone_ns != 0 && monotonic_ns() - t->clone_ns < BT_CLONE_GRACE_NS))
    return 0;
  if (t->refollow == NULL || t->refollow[BT_REFOLLOW_HOOK] == 0x90 /* not hooked yet */) {
    if (!t->renew_stub_asked)
      put_callout(iterator, cw, t, on_renew_stub_needed, t);
    t->renew_stub_asked = 1;
    return 0;
  }
  uint64_t *renewal = new_spilled(t); /* {t, start}: as a spilled block's */
  if (renewal == NULL)
    return 0;
  renewal[1] = start;
  put_callout(iterator, cw, t, on_renewal, renewal);
  static const uint8_t jmp_rip[] = {0xff, 0x25, 0, 0, 0, 0};
  put_bytes(cw, jmp_rip, sizeof jmp_rip);
  put_bytes(cw, (const uint8_t *)&t->refollow, 8);
  const cs_insn *insn;
  while (gum_stalker_iterator_next(iterator, &insn))
    ; /* none of it kept: the fresh context compiles the block */
  return 1;
}

/* Before a syscall instruction: the callout that closes the ring, only for exit and
   exit_group.  A callout for every system call cost 115 ns each (3M getppid(): 0.5 s
   native, traced 0.85 s with it); rcx is free here, as the syscall overwrites it, so the
   test is flag-free:
     lea rcx, [rax-60]; jrcxz exit; lea rcx, [rax-231]; jrcxz exit; jmp go
     exit: callout
     go:   syscall
   `label` is any address unique to this block. */
/* Before a system call instruction: exit and exit_group end the thread's ring
   (on_exit_syscall); close and close_range spare Frida's files (on_close, on_close_range).
   Each check is a lea and a jrcxz (rcx, which the syscall overwrites anyway), so that no
   flag changes; a callout costs about 115 ns, so only these calls pay one. */
static void put_unless_nr(GumX86Writer *cw, int32_t nr, gconstpointer next) {
  uint8_t check[] = {
      0x48, 0x8d, 0x88, 0, 0, 0, 0, /* lea rcx, [rax-nr] */
      0xe3, 0x05,                   /* jrcxz (over the jmp) */
  };
  *(int32_t *)(check + 3) = -nr;
  put_bytes(cw, check, sizeof check);
  gum_x86_writer_put_jmp_near_label(cw, next);
}

static void put_check(GumStalkerIterator *iterator, GumX86Writer *cw, BtThread *t,
                      int32_t nr, GumStalkerCallout callout, gconstpointer go,
                      gconstpointer next) {
  put_unless_nr(cw, nr, next);
  put_callout(iterator, cw, t, callout, t);
  gum_x86_writer_put_jmp_near_label(cw, go);
  gum_x86_writer_put_label(cw, next);
}

/* vfork(): its child runs in the parent's memory, on its stack, until it execs or exits,
   while the parent waits.  Gum leaves a clone() with CLONE_VM (posix_spawn(), threads) to
   run natively in the child, but a vfork() child ran on in the parent thread's compiled
   code: its records went into the parent's ring (Python's subprocess: the child's close()
   calls in the parent's trace), and the blocks it compiled first, as a forked child's,
   had none, so the parent ran them unrecorded ever after (the `ret` of __vfork itself: the
   parent's trace took its `jae` for a jump to the caller).  So the system call is made here
   and the child goes on natively after it, as Gum's clone() children do; the parent goes
   on in the compiled code, after the instruction's copy (vfork_done, placed by
   transform).  Both get rcx as the kernel leaves it natively (the return address) and the
   flags untouched (lea and jrcxz):
     lea rcx, [rax-58]; jrcxz vfork; jmp next
     vfork: syscall; mov rcx, rax; jrcxz child
            movabs rcx, address+2; jmp vfork_done
     child: movabs rcx, address+2; jmp rcx
     next: */
static gconstpointer vfork_done(uint64_t address) {
  return (gconstpointer)(address | (1ULL << 54));
}

static void put_vfork(GumX86Writer *cw, uint64_t address) {
  gconstpointer next = (gconstpointer)(address | (1ULL << 53));
  put_unless_nr(cw, 58 /* vfork */, next);
  uint8_t call[17] = {0x0f, 0x05,       /* syscall */
                      0x48, 0x89, 0xc1, /* mov rcx, rax */
                      0xe3, 0x0f,       /* jrcxz child (over the movabs and the jmp) */
                      0x48, 0xb9};      /* movabs rcx, back */
  *(uint64_t *)(call + 9) = address + 2;
  put_bytes(cw, call, sizeof call);
  gum_x86_writer_put_jmp_near_label(cw, vfork_done(address));
  uint8_t child[12] = {0x48, 0xb9, [10] = 0xff, 0xe1}; /* movabs rcx, back; jmp rcx */
  *(uint64_t *)(child + 2) = address + 2;
  put_bytes(cw, child, sizeof child);
  gum_x86_writer_put_label(cw, next);
}

static void put_syscall_checks(GumStalkerIterator *iterator, GumX86Writer *cw, BtThread *t,
                               uint64_t address) {
  /* labels of this syscall instruction's own: its address with high bits set */
  gconstpointer go = (gconstpointer)(address | (1ULL << 63));
  /* first a read of the header page: a signal held there (hold_signal) goes in before the
     call, at its instruction (mov rcx, [wp]) */
  if (t->header32 != NULL && t->wpp == (uint64_t *)(t->header32 + BT_OFF_INLINE_PTR) &&
      (uint64_t)t->wpp < 0x80000000u)
    put_mov_reg_abs(cw, 0x8b, 1 /* rcx */, (uint32_t)(uint64_t)t->wpp);
  /* t->syscall_at = address (bt_thread_asleep_at), in rcx, which the instruction overwrites;
     the flags stay.  movabs rcx, &t->syscall_at; mov dword [rcx], low; mov dword [rcx+4], high */
  uint8_t note_address[23] = {0x48, 0xb9, [10] = 0xc7, 0x01, [16] = 0xc7, 0x41, 0x04};
  uint64_t field = (uint64_t)&t->syscall_at;
  for (int i = 0; i < 8; i++)
    note_address[2 + i] = (uint8_t)(field >> (8 * i));
  for (int i = 0; i < 4; i++) {
    note_address[12 + i] = (uint8_t)(address >> (8 * i));
    note_address[19 + i] = (uint8_t)(address >> (32 + 8 * i));
  }
  put_bytes(cw, note_address, sizeof note_address);
  put_vfork(cw, address);
  put_check(iterator, cw, t, 3 /* close */, on_close, go,
            (gconstpointer)(address | (1ULL << 62)));
  put_check(iterator, cw, t, 436 /* close_range */, on_close_range, go,
            (gconstpointer)(address | (1ULL << 61)));
  put_check(iterator, cw, t, 131 /* sigaltstack */, on_sigaltstack, go,
            (gconstpointer)(address | (1ULL << 58)));
  const BtCodeRange *range = code_range(address);
  if (range != NULL && !range->fridas) /* the program's: not the agent's own calls */
    put_check(iterator, cw, t, 13 /* rt_sigaction */, on_rt_sigaction, go,
              (gconstpointer)(address | (1ULL << 57)));
  put_check(iterator, cw, t, 56 /* clone */, on_clone, go,
            (gconstpointer)(address | (1ULL << 56)));
  put_check(iterator, cw, t, 435 /* clone3 */, on_clone, go,
            (gconstpointer)(address | (1ULL << 55)));
  put_check(iterator, cw, t, 59 /* execve */, on_exec_syscall, go,
            (gconstpointer)(address | (1ULL << 60)));
  put_check(iterator, cw, t, 322 /* execveat */, on_exec_syscall, go,
            (gconstpointer)(address | (1ULL << 59)));
  static const uint8_t exit_check[] = {
      0x48, 0x8d, 0x48, 0xc4,                   /* lea rcx, [rax-60] */
      0xe3, 0x0e,                               /* jrcxz exit (over 14 bytes) */
      0x48, 0x8d, 0x88, 0x19, 0xff, 0xff, 0xff, /* lea rcx, [rax-231] */
      0xe3, 0x05,                               /* jrcxz exit (over the jmp) */
  };
  put_bytes(cw, exit_check, sizeof exit_check);
  gum_x86_writer_put_jmp_near_label(cw, go);
  put_callout(iterator, cw, t, on_exit_syscall, t);
  gum_x86_writer_put_label(cw, go);
}

/* record --trigger: a callout before the instruction at a trigger's address, where the
   script (bt_trigger_reached) has the host copy every ring and waits for it.  Gum's callout
   keeps the thread's whole state and runs on a stack of Gum's.  An Interceptor hook there
   did neither: a call listener took the word at the stack pointer for a return address and
   put its own there (in the middle of a function, the caller's frame pointer: `avx512 regs`
   printed garbage for its round count and never ended), and a probe pushed into the red
   zone (`vectors`' leaf function lost its loop counter and never returned) and left
   glibc's AVX routines in the script change the vector registers (2 of 2,000 rounds of
   `avx512 regs`, one per snapshot).  bt_triggers: how many, then each one's address and
   index. */
extern uint64_t bt_triggers[];
extern void bt_trigger_reached(uint64_t index);

static void on_trigger(GumCpuContext *cpu, gpointer user_data) {
  bt_trigger_reached((uint64_t)user_data);
}

/* A `ret` or an indirect `call` of the program's, before Gum's code for it.  Gum compiles
   both as a lookup in the block's inline cache ({real_start, code_start} pairs, the newest
   first) behind a switch to its own stack and lahf/sahf: five stores and some 22
   instructions each time, most of what Stalker costs in a call-heavy loop once the records
   are written (perf over `record -- calls`: the core is bound by its stores).  The agent
   reads the first BT_IC_FAST entries of that same cache itself, without a stack switch or
   the flags: rcx and rdx are saved below the stack pointer (at a `ret`, the returning
   function's frame; at a `call`, where the call puts the return address and the callee
   its frame: dead either way, and a signal's frame goes below the 128-byte red zone, so
   it cannot overwrite them), the target loaded into rdx, and each entry compared as
   `lea rcx, [~real + target + 1]; jrcxz` (zero when equal; an empty entry's real_start is
   NULL, which no target is).  On a hit: rcx and rdx back, the return address popped (a
   `ret`) or pushed (a `call`), and a jump to the entry's code, as Gum's own hit does.  On
   a miss, Gum's code, unchanged (its slow path fills the cache read here).  The cache's
   address is known only once Gum has written its code: the displacements are patched in
   then (finish_ic_fast_path), or the whole thing is jumped over when Gum's code is not as
   expected.  No instruction of the program runs in between: a signal here is one in the
   block's branch code (in_branch_code).  Indirect jumps keep Gum's code: a leaf function
   may hold data below its stack pointer across one (a switch). */
#define BT_IC_FAST 4
#define BT_IC_SAVE 10  /* mov [rsp-16], rcx; mov [rsp-24], rdx */
#define BT_IC_CHECK 17 /* mov rcx, [rip+real]; not rcx; lea rcx, [rcx+rdx+1]; jrcxz hit */
#define BT_IC_MISS 15  /* the restore; jmp to Gum's code */
#define BT_IC_RESTORE 10
#define BT_IC_RET_HIT (BT_IC_RESTORE + 11)  /* lea rsp, [rsp+8]; jmp [rip+code] */
#define BT_IC_CALL_HIT (BT_IC_RESTORE + 26) /* movabs rcx; mov [rsp-8], rcx; lea; jmp */
#define BT_IC_LOAD_MAX 16
#define BT_IC_EMPTY 0xbaadd00ddeadfaceULL /* GUM_IC_MAGIC_EMPTY: an unused entry's code */

typedef struct {
  uint8_t *code;   /* where its bytes are, NULL: none put */
  uint64_t pc;     /* where they run */
  unsigned checks; /* the first check's offset */
  unsigned hits;   /* the first hit's offset */
  unsigned hit;    /* a hit's size */
} BtIcFast;

/* The bytes that load the target of `insn` into rdx (the program's registers all as they
   were, rcx and rdx too), or 0 when the fast path does not take it: only a plain `ret`
   (or `rep ret`) and a `call` through a register or memory, no segment override. */
static unsigned ic_target_load(const cs_insn *insn, uint8_t *load) {
  const uint8_t *b = insn->bytes;
  if ((insn->size == 1 && b[0] == 0xc3) || (insn->size == 2 && b[0] == 0xf3 && b[1] == 0xc3)) {
    static const uint8_t from_stack[] = {0x48, 0x8b, 0x14, 0x24}; /* mov rdx, [rsp] */
    for (unsigned i = 0; i < sizeof from_stack; i++)
      load[i] = from_stack[i];
    return sizeof from_stack;
  }
  if (insn->id != X86_INS_CALL || insn->detail == NULL || insn->detail->x86.op_count != 1)
    return 0;
  unsigned at = 0;
  while (at < insn->size && (b[at] == 0x3e /* notrack */ || b[at] == 0xf2 /* bnd */))
    at++;
  uint8_t rex = 0;
  if (at < insn->size && (b[at] & 0xf0) == 0x40)
    rex = b[at++];
  if (at + 1 >= insn->size || b[at] != 0xff || ((b[at + 1] >> 3) & 7) != 2 /* call r/m */)
    return 0;
  const cs_x86_op *op = &insn->detail->x86.operands[0];
  if (op->type == X86_OP_REG) {
    unsigned rm = (b[at + 1] & 7) | ((rex & 1) << 3);
    if ((b[at + 1] >> 6) != 3 || rm == 4 /* rsp */)
      return 0;
    load[0] = 0x48 | (rex & 1); /* mov rdx, r */
    load[1] = 0x8b;
    load[2] = 0xd0 | (b[at + 1] & 7);
    return 3;
  }
  if (op->type != X86_OP_MEM || op->mem.segment != X86_REG_INVALID)
    return 0;
  if (op->mem.base == X86_REG_RIP) { /* movabs rdx, address; mov rdx, [rdx] */
    uint64_t address = insn->address + insn->size + (uint64_t)op->mem.disp;
    load[0] = 0x48;
    load[1] = 0xba;
    for (int i = 0; i < 8; i++)
      load[2 + i] = (uint8_t)(address >> (8 * i));
    load[10] = 0x48;
    load[11] = 0x8b;
    load[12] = 0x12;
    return 13;
  }
  /* mov rdx, [the same address]: the call's ModRM (its reg field is 2, rdx), SIB and
     displacement, under REX.W with the call's X and B */
  unsigned rest = insn->size - (at + 1);
  if (2 + rest > BT_IC_LOAD_MAX)
    return 0;
  load[0] = 0x48 | (rex & 3);
  load[1] = 0x8b;
  for (unsigned i = 0; i < rest; i++)
    load[2 + i] = b[at + 1 + i];
  return 2 + rest;
}

static void put_ic_fast_path(GumX86Writer *cw, const cs_insn *insn, const uint8_t *load,
                             unsigned load_size, BtIcFast *fast) {
  static const uint8_t save[BT_IC_SAVE] = {
      0x48, 0x89, 0x4c, 0x24, 0xf0, /* mov [rsp-16], rcx */
      0x48, 0x89, 0x54, 0x24, 0xe8, /* mov [rsp-24], rdx */
  };
  static const uint8_t restore[BT_IC_RESTORE] = {
      0x48, 0x8b, 0x4c, 0x24, 0xf0, /* mov rcx, [rsp-16] */
      0x48, 0x8b, 0x54, 0x24, 0xe8, /* mov rdx, [rsp-24] */
  };
  static const uint8_t check[BT_IC_CHECK - 1] = {
      0x48, 0x8b, 0x0d, 0, 0, 0, 0, /* mov rcx, [rip+real_start] (patched) */
      0x48, 0xf7, 0xd1,             /* not rcx */
      0x48, 0x8d, 0x4c, 0x11, 0x01, /* lea rcx, [rcx+rdx+1] */
      0xe3,                         /* jrcxz hit (its displacement follows) */
  };
  int is_call = insn->id == X86_INS_CALL;
  fast->code = cw->code;
  fast->pc = cw->pc;
  fast->checks = BT_IC_SAVE + load_size;
  fast->hits = fast->checks + BT_IC_FAST * BT_IC_CHECK + BT_IC_MISS;
  fast->hit = is_call ? BT_IC_CALL_HIT : BT_IC_RET_HIT;
  put_bytes(cw, save, sizeof save);
  put_bytes(cw, load, load_size);
  for (unsigned e = 0; e < BT_IC_FAST; e++) {
    uint8_t to_hit = (uint8_t)((BT_IC_FAST - 1 - e) * BT_IC_CHECK + BT_IC_MISS + e * fast->hit);
    put_bytes(cw, check, BT_IC_CHECK - 1);
    put_bytes(cw, &to_hit, 1); /* jrcxz's displacement */
  }
  put_bytes(cw, restore, sizeof restore);
  uint8_t past_hits[5] = {0xe9}; /* jmp to Gum's code, past the hits */
  *(int32_t *)(past_hits + 1) = (int32_t)(BT_IC_FAST * fast->hit);
  put_bytes(cw, past_hits, sizeof past_hits);
  /* a call's return address in one store: the callee's `ret` loads it whole, and a load
     from two smaller stores waits for both to reach the cache (an indirect call loop took
     2.0 s instead of 1.4-1.6) */
  /* movabs rcx, return address; mov [rsp-8], rcx */
  uint8_t push_return[15] = {0x48, 0xb9, [10] = 0x48, 0x89, 0x4c, 0x24, 0xf8};
  *(uint64_t *)(push_return + 2) = insn->address + insn->size;
  static const uint8_t push[5] = {0x48, 0x8d, 0x64, 0x24, 0xf8}; /* lea rsp, [rsp-8] */
  static const uint8_t pop[5] = {0x48, 0x8d, 0x64, 0x24, 0x08};  /* lea rsp, [rsp+8] */
  static const uint8_t jmp_rip[6] = {0xff, 0x25}; /* jmp [rip+code_start] (patched) */
  for (unsigned e = 0; e < BT_IC_FAST; e++) {
    if (is_call)
      put_bytes(cw, push_return, sizeof push_return);
    put_bytes(cw, restore, sizeof restore);
    put_bytes(cw, is_call ? push : pop, 5);
    put_bytes(cw, jmp_rip, sizeof jmp_rip);
  }
}

/* After Gum's code for the instruction (from `gum` to `end`): its cache's address, from
   the `movabs rbx, entries; cmp [rbx], rax; je` that starts its lookup, checked as a
   fresh cache (every entry read is empty). */
static uint64_t gum_inline_cache(const uint8_t *gum, const uint8_t *end) {
  static const uint8_t lookup[] = {0x48, 0x39, 0x43, 0x00, 0x0f, 0x84};
  for (const uint8_t *p = gum; p + 10 + sizeof lookup <= end; p++) {
    if (p[0] != 0x48 || p[1] != 0xbb || !same_bytes(p + 10, lookup, sizeof lookup))
      continue;
    uint64_t entries = *(const uint64_t *)(p + 2), seen[2 * BT_IC_FAST];
    if (!read_safely((const void *)entries, seen, sizeof seen))
      return 0;
    for (unsigned e = 0; e < BT_IC_FAST; e++)
      if (seen[2 * e] != 0 || seen[2 * e + 1] != BT_IC_EMPTY)
        return 0;
    return entries;
  }
  return 0;
}

static int put_rip_displacement(uint8_t *field, uint64_t next_pc, uint64_t target) {
  int64_t d = (int64_t)(target - next_pc);
  if (d != (int32_t)d)
    return 0;
  *(int32_t *)field = (int32_t)d;
  return 1;
}

static void finish_ic_fast_path(const BtIcFast *fast, const uint8_t *gum, const uint8_t *end) {
  uint64_t entries = gum_inline_cache(gum, end);
  int ok = entries != 0;
  for (unsigned e = 0; ok && e < BT_IC_FAST; e++) {
    unsigned check = fast->checks + e * BT_IC_CHECK, hit = fast->hits + (e + 1) * fast->hit;
    ok = put_rip_displacement(fast->code + check + 3, fast->pc + check + 7, entries + 16 * e) &&
         put_rip_displacement(fast->code + hit - 4, fast->pc + hit, entries + 16 * e + 8);
  }
  if (!ok) { /* jmp to Gum's code */
    fast->code[0] = 0xe9;
    *(int32_t *)(fast->code + 1) = (int32_t)(gum - (fast->code + 5));
  }
}

void transform(GumStalkerIterator *iterator, GumStalkerOutput *output, gpointer user_data) {
  BtThread *t = user_data;
  GumX86Writer *cw = output->writer.x86;
  const cs_insn *insn;
  uint32_t *slot = NULL; /* where the block id goes */
  uint64_t id = 0;
  uint64_t *spilled = NULL;
  int tail_slow = 0; /* the record's slow path goes after the last instruction */
  int r = -1;        /* the dead register the record uses, or -1: rax, saved */
  uint64_t start = 0, last = 0;
  uint64_t wp_addr = (uint64_t)t->wpp;
  uint64_t copy = 0; /* where the block's copy starts, for a block of the program's */
  uint16_t offsets[2 * BT_COPY_MAX]; /* BtCopy's, the copy's first */
  uint16_t record_at[6] = {0, 0, 0, 0, 0, 0}; /* BtCopy's read_at ... branch_end (spilled:
                                                  0) */
  unsigned mapped = 0;

  int first = 1;
  if (in_forked_child()) { /* a forked child runs on, unrecorded */
    while (gum_stalker_iterator_next(iterator, &insn))
      gum_stalker_iterator_keep(iterator);
    return;
  }
  widen_inline_cache(iterator);
  if (!t->altstack_tried && STATE->faults_taken != 0)
    arm_altstack(t);
  uint8_t *exec_ctx = *(uint8_t **)iterator; /* GumStalkerIterator.exec_context */
  if (exec_ctx != t->exec_ctx)
    t->ctx_blocks = 0;
  t->exec_ctx = exec_ctx; /* (context_to_let_go) */
  while (gum_stalker_iterator_next(iterator, &insn)) {
    int is_first = first;
    if (first && (is_frida_code(insn->address) || insn->address == restorer_syscall())) {
      /* Frida's own code (the hook that started us, its trampolines): not the program */
      if (insn->address == restorer_syscall())
        put_callout(iterator, cw, t, on_restorer_followed, t);
    } else if (first && t->ctx_blocks++ >= BT_CONTEXT_BLOCKS &&
               put_renewal(iterator, cw, t, insn->address)) {
      return; /* the block is a jump to the refollow stub */
    } else if (first && (insn->address >> BT_BLOCK_ADDR_BITS) != 0) {
      /* TODO(LA57): only with 5-level paging; counted and reported, never silent */
      t->far_blocks++;
    } else if (first && t->next_id >= t->table_cap) {
      copy = cw->pc;
      start = insn->address;
      spilled = new_spilled(t);
      if (spilled != NULL)
        put_callout(iterator, cw, t, on_spilled_block, spilled);
      else
        t->far_blocks++;
    } else if (first) {
      copy = cw->pc;
      start = insn->address;
      int flags_dead = 0;
      csh cs = gum_stalker_iterator_get_capstone(iterator);
      uint32_t dead = wp_addr < 0x80000000u ? dead_state(t, cs, start, &flags_dead) : 0;
      if (flags_dead) /* the check is test/jz to the tail: any dead register */
        for (int i = 0; i < 16 && r < 0; i++)
          if (dead & (1u << i))
            r = i;
      else if (dead & (1u << 1))
        r = 1; /* rcx: the check is jrcxz, the flags stay untouched */
      id = t->next_id++;
      BtRecordAt at;
      slot = r >= 0 ? put_short_record(iterator, cw, t, r, flags_dead, start, &at)
                    : put_saving_record(iterator, cw, t, flags_dead, start, &at);
      record_at[0] = (uint16_t)(at.read - copy);
      record_at[1] = (uint16_t)(at.written - copy);
      record_at[2] = (uint16_t)(at.check_end - copy);
      record_at[3] = (uint16_t)(at.restore - copy);
      record_at[4] = (uint16_t)(cw->pc - copy);
      tail_slow = flags_dead;
    }
    if (copy != 0 && mapped < BT_COPY_MAX) {
      /* the first instruction's place takes in the record's code before it */
      offsets[mapped] = first ? 0 : (uint16_t)(cw->pc - copy);
      offsets[BT_COPY_MAX + mapped] = (uint16_t)(insn->address - start);
    }
    mapped += copy != 0;
    first = 0;
    last = insn->address;
    int triggered = 0;
    for (uint64_t k = 0; k < bt_triggers[0]; k++)
      if (bt_triggers[1 + 2 * k] == insn->address) {
        put_callout(iterator, cw, t, on_trigger, (gpointer)bt_triggers[2 + 2 * k]);
        triggered = 1;
      }
    if (insn->id == X86_INS_SYSCALL)
      put_syscall_checks(iterator, cw, t, insn->address);
    if (insn->size == 5 && insn->bytes[0] == 0xe8 && STATE->tls_dtors != 0
        && insn->address + 5 + *(const int32_t *)&insn->bytes[1] == STATE->tls_dtors)
      put_callout(iterator, cw, t, on_thread_ending, t);
    /* past the first instruction (and without a callout before it) no prolog of Gum's is
       open here, where the fast path runs and the signal stub comes (bt_signal_enter) */
    BtIcFast fast = {NULL, 0, 0, 0, 0};
    uint8_t load[BT_IC_LOAD_MAX];
    unsigned load_size = copy != 0 && !is_first && !triggered ? ic_target_load(insn, load) : 0;
    if (load_size != 0)
      put_ic_fast_path(cw, insn, load, load_size, &fast);
    if (copy != 0 && !is_first && insn->size == 1 && insn->bytes[0] == 0xc3) {
      t->ret_copy = cw->pc; /* Gum's own code for it, past the fast path */
      t->ret_copy_ctx = exec_ctx;
    }
    const uint8_t *gum = cw->code;
    gum_stalker_iterator_keep(iterator);
    if (insn->id == X86_INS_SYSCALL)
      gum_x86_writer_put_label(cw, vfork_done(insn->address));
    if (fast.code != NULL)
      finish_ic_fast_path(&fast, gum, cw->code);
  }
  if (copy != 0)
    record_at[5] = (uint16_t)(cw->pc - copy);
  if (tail_slow)
    put_tail_slow_path(iterator, cw, t, slot, r, start);
  if (copy != 0) {
    unsigned n = mapped < BT_COPY_MAX ? mapped : BT_COPY_MAX;
    for (unsigned i = 0; i < n; i++)
      offsets[n + i] = offsets[BT_COPY_MAX + i];
    add_copy(t, copy, cw->pc - copy, start, n, mapped <= BT_COPY_MAX, offsets, record_at);
  }
  /* Stalker ends a block at every branch, so it spans a few dozen bytes: the offset of
     its last instruction always fits the 16 bits of a BLOCK word. */
  uint64_t record = start | ((last - start) << BT_BLOCK_ADDR_BITS);
  if (slot != NULL) {
    /* the entry before the count that covers it, both before the block first runs, so
       any reader that finds the id finds its entry */
    t->table[id] = record;
    bt_barrier();
    BT_HDR64(&t->w, BT_OFF_TABLE_COUNT) = id + 1;
    *slot = (uint32_t)id;
  } else if (spilled != NULL) {
    spilled[1] = record;
    BT_HDR64(&t->w, BT_OFF_TABLE_SPILLED) = BT_HDR64(&t->w, BT_OFF_TABLE_SPILLED) + 1;
  }
}

uint64_t bt_thread_far_blocks(BtThread *t) {
  return t->far_blocks;
}
