/* A fault of each kind, for traces that end at the faulting instruction.  MODE:
   segv   poke() writes through NULL          bus    peek() reads a page past a file's end
   fpe    divide() divides by zero            ill    trap() runs ud2
   abort  give_up() calls abort()
   int3   an int3 instruction                 raise  raise(SIGSEGV): sent, not a fault
   recover  poke() faults 3 times under a SIGSEGV handler that siglongjmps back to main,
            which prints "recovered 3" and returns 0
   where  says whether the thread has a signal stack ("signal stack: none"), then poke()
          faults under a SA_SIGINFO handler that says whether the interrupted pc it is given
          lies in poke ("fault in poke") and whether it runs on the thread's stack, below the
          interrupted stack pointer ("handler on the thread's stack"), then exits 3
   retry  poke() writes to a page it may not, under a handler that lets it (mprotect) and
          returns, so that the write is made again and succeeds; then after() is called 3
          times, and "retried" printed
   skip   poke() faults under a SA_SIGINFO handler that moves the pc on to resumed(), which
          calls after() 3 times, prints "skipped 3" and exits 0
   raw    a SIGSEGV handler is set with the rt_sigaction system call itself, as a runtime
          does (Go's); prints "registered" and reads a line; poke() faults, and the
          handler says whether the interrupted pc it is given lies in poke ("raw handler:
          fault in poke"), then exits 3
   backtrace  poke() faults under a handler that says how many frames backtrace() finds
              ("frames: N") and whether one of them is in poke ("poke in the backtrace"),
              then exits 3
   overflow          descend() recurses until the stack overflows (at 256 KiB, its limit
                     lowered to keep the trace short)
   overflow-deep     the same on the whole stack (8 MiB, as the limit usually is)
   overflow-thread   the same in a thread of its own, whose 256 KiB stack ends at a guard
                     page
   overflow-altstack under a SA_ONSTACK handler on a signal stack of the program's, which
                     prints "overflowed at depth N" (the deepest call that stored its
                     depth) and exits 4
   overflow-handler  under a handler but no signal stack: the kernel finds no room for the
                     handler, which would print "handler ran" and exit 5
   recover-overflow  recover, then overflow
   A second argument: "wait" prints "ready" and reads a line first; "armed" does so once
   the handler of where, skip or backtrace is set, right before the fault (to be attached to
   then); "child" has a forked child fault, and prints how it ended ("child: signal N" or
   "child: exit N"). */
#define _GNU_SOURCE
#include <execinfo.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <sys/wait.h>
#include <unistd.h>

volatile int zero;
static sigjmp_buf back;

__attribute__((noinline)) void poke(int *p) { *p = 42; }
__attribute__((noinline)) int peek(const char *p) { return *(volatile const char *)p; }
__attribute__((noinline)) int divide(int n) { return n / zero; }
__attribute__((noinline)) void trap(void) { __builtin_trap(); }
__attribute__((noinline)) void give_up(void) { abort(); }

volatile int reached;

__attribute__((noinline)) int descend(int depth) {
  volatile char frame[256];
  reached = depth;
  frame[0] = (char)depth;
  return descend(depth + 1) + frame[0];
}

static void *descend_in_thread(void *unused) { return (void *)(intptr_t)descend(0); }

static int overflow(void) {
  struct rlimit stack;
  getrlimit(RLIMIT_STACK, &stack);
  stack.rlim_cur = 256 * 1024;
  setrlimit(RLIMIT_STACK, &stack);
  return descend(0);
}

static void say(const char *text, int status) {
  write(1, text, strlen(text));
  _exit(status);
}

static void on_overflow(int sig) {
  char text[48] = "overflowed at depth ", digits[12];
  int n = 0, at = strlen(text);
  for (int left = reached; n == 0 || left > 0; left /= 10)
    digits[n++] = (char)('0' + left % 10);
  while (n > 0)
    text[at++] = digits[--n];
  text[at] = '\n';
  text[at + 1] = 0;
  say(text, 4);
}
static void on_overflow_unseen(int sig) { say("handler ran\n", 5); }

static void on_segv(int sig) { siglongjmp(back, sig); }

static void on_segv_where(int sig, siginfo_t *info, void *context) {
  ucontext_t *uc = context;
  unsigned long pc = (unsigned long)uc->uc_mcontext.gregs[REG_RIP];
  unsigned long at = (unsigned long)poke;
  unsigned long sp = (unsigned long)uc->uc_mcontext.gregs[REG_RSP];
  unsigned long here = (unsigned long)&at;
  printf("fault %s poke\n", pc >= at && pc < at + 32 ? "in" : "not in");
  printf("handler %s the thread's stack\n", here < sp && here > sp - 65536 ? "on" : "not on");
  fflush(stdout);
  _exit(3);
}

static void on_segv_backtrace(int sig) {
  void *frames[64];
  int n = backtrace(frames, 64), in_poke = 0;
  for (int i = 0; i < n; i++)
    in_poke |= (char *)frames[i] >= (char *)poke && (char *)frames[i] < (char *)poke + 32;
  printf("frames: %d\n%s\n", n, in_poke ? "poke in the backtrace" : "poke not in it");
  fflush(stdout);
  _exit(3);
}

static char *locked;
__attribute__((noinline)) void after(void) { zero++; }

static void on_segv_unlock(int sig) { mprotect(locked, 4096, PROT_READ | PROT_WRITE); }

/* entered from poke's fault with poke's stack pointer: as after a call, so aligned */
__attribute__((noinline, noreturn)) void resumed(void) {
  for (int i = 0; i < 3; i++)
    after();
  printf("skipped %d\n", zero);
  fflush(stdout);
  _exit(0);
}

static void on_segv_skip(int sig, siginfo_t *info, void *context) {
  ((ucontext_t *)context)->uc_mcontext.gregs[REG_RIP] = (greg_t)resumed;
}

/* the kernel's struct sigaction, and a restorer of our own, as a runtime has */
struct kernel_sigaction {
  void (*handler)(int, siginfo_t *, void *);
  unsigned long flags;
  void (*restorer)(void);
  unsigned long mask;
};
extern void raw_restore(void);
__asm__(".text\n"
        "raw_restore:\n"
        "  mov $15, %rax\n"
        "  syscall\n");

static void on_segv_raw(int sig, siginfo_t *info, void *context) {
  unsigned long pc = (unsigned long)((ucontext_t *)context)->uc_mcontext.gregs[REG_RIP];
  unsigned long at = (unsigned long)poke;
  say(pc >= at && pc < at + 32 ? "raw handler: fault in poke\n" : "raw handler: elsewhere\n", 3);
}

static int fault(const char *mode);
static int wait_when_armed;

/* The handler is set: with "armed", say so and wait for a line. */
static void armed(void) {
  char line[8];
  if (!wait_when_armed)
    return;
  puts("ready");
  fflush(stdout);
  if (!fgets(line, sizeof line, stdin))
    exit(1);
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "segv";
  const char *how = argc > 2 ? argv[2] : "";
  wait_when_armed = !strcmp(how, "armed");
  if (!strcmp(how, "wait")) {
    char line[8];
    puts("ready");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
      return 1;
  }
  if (!strcmp(how, "child")) {
    pid_t child = fork();
    if (child == 0)
      _exit(fault(mode));
    int status;
    waitpid(child, &status, 0);
    if (WIFSIGNALED(status))
      printf("child: signal %d\n", WTERMSIG(status));
    else
      printf("child: exit %d\n", WEXITSTATUS(status));
    return 0;
  }
  return fault(mode);
}

static int fault(const char *mode) {
  if (!strcmp(mode, "segv"))
    poke(NULL);
  if (!strcmp(mode, "bus")) {
    FILE *empty = tmpfile();
    char *page = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fileno(empty), 0);
    return peek(page);
  }
  if (!strcmp(mode, "fpe"))
    return divide(100);
  if (!strcmp(mode, "ill"))
    trap();
  if (!strcmp(mode, "abort"))
    give_up();
  if (!strcmp(mode, "int3"))
    __asm__ volatile("int3");
  if (!strcmp(mode, "raise"))
    raise(SIGSEGV);
  if (!strcmp(mode, "where")) {
    stack_t ss;
    sigaltstack(NULL, &ss);
    printf("signal stack: %s\n", ss.ss_flags & SS_DISABLE ? "none" : "set");
    struct sigaction act = {.sa_sigaction = on_segv_where, .sa_flags = SA_SIGINFO};
    sigaction(SIGSEGV, &act, NULL);
    armed();
    poke(NULL);
  }
  if (!strcmp(mode, "overflow"))
    return overflow();
  if (!strcmp(mode, "retry")) {
    locked = mmap(NULL, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    signal(SIGSEGV, on_segv_unlock);
    poke((int *)locked);
    for (int i = 0; i < 3; i++)
      after();
    printf("retried %d\n", *(int *)locked);
    return 0;
  }
  if (!strcmp(mode, "skip")) {
    struct sigaction act = {.sa_sigaction = on_segv_skip, .sa_flags = SA_SIGINFO};
    sigaction(SIGSEGV, &act, NULL);
    armed();
    poke(NULL);
  }
  if (!strcmp(mode, "raw")) {
    struct kernel_sigaction act = {on_segv_raw, SA_SIGINFO | 0x04000000 /* SA_RESTORER */,
                                   raw_restore, 0};
    char line[8];
    syscall(SYS_rt_sigaction, SIGSEGV, &act, NULL, 8);
    puts("registered");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
      return 1;
    poke(NULL);
  }
  if (!strcmp(mode, "backtrace")) {
    void *warm[1];
    backtrace(warm, 1); /* loads libgcc_s now, not in the handler */
    signal(SIGSEGV, on_segv_backtrace);
    armed();
    poke(NULL);
  }
  if (!strcmp(mode, "overflow-deep"))
    return descend(0);
  if (!strcmp(mode, "overflow-thread")) {
    pthread_t thread;
    pthread_attr_t attr;
    void *result;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    pthread_create(&thread, &attr, descend_in_thread, NULL);
    pthread_join(thread, &result);
    return 1;
  }
  if (!strcmp(mode, "overflow-altstack")) {
    stack_t ss = {.ss_sp = malloc(65536), .ss_size = 65536};
    sigaltstack(&ss, NULL);
    struct sigaction act = {.sa_handler = on_overflow, .sa_flags = SA_ONSTACK};
    sigaction(SIGSEGV, &act, NULL);
    return overflow();
  }
  if (!strcmp(mode, "overflow-handler")) {
    signal(SIGSEGV, on_overflow_unseen);
    return overflow();
  }
  if (!strcmp(mode, "recover") || !strcmp(mode, "recover-overflow")) {
    signal(SIGSEGV, on_segv);
    int recovered = 0;
    for (int i = 0; i < 3; i++)
      if (sigsetjmp(back, 1) == 0)
        poke(NULL);
      else
        recovered++;
    printf("recovered %d\n", recovered);
    fflush(stdout);
    if (!strcmp(mode, "recover-overflow")) {
      signal(SIGSEGV, SIG_DFL);
      return overflow();
    }
    return 0;
  }
  return 1;
}
