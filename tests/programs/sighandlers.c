/* Signal handlers of every shape, each calling f: an SA_SIGINFO handler that checks the pc
   its frame holds lies in the C library, whose raise() was interrupted (the program's own
   code, not a tracer's copy of it), a handler interrupted by another signal it raises
   (nested), and one that leaves by siglongjmp() back into main.  Prints the sum of f's
   arguments, where the pc was, the rounds that jumped, and whether sigaction() and
   signal() give the program back its own handlers (a tracer may have put its own in the
   kernel). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <ucontext.h>

volatile long sink;
static volatile int pc_in_libc = -1;
static sigjmp_buf back;
__attribute__((noinline)) void f(long i) { sink += i; }

static void with_info(int sig, siginfo_t *info, void *context) {
  ucontext_t *uc = context;
  Dl_info where;
  pc_in_libc = dladdr((void *)uc->uc_mcontext.gregs[REG_RIP], &where) != 0 &&
               strstr(where.dli_fname, "libc.so") != NULL;
  f(1);
}

static void inner(int sig) { f(10); }

static void outer(int sig) {
  f(100);
  raise(SIGUSR2);
  f(1000);
}

static void leaving(int sig) {
  f(10000);
  siglongjmp(back, 1);
}

int main(void) {
  struct sigaction act = {0};
  act.sa_sigaction = with_info;
  act.sa_flags = SA_SIGINFO;
  sigaction(SIGUSR1, &act, NULL);
  signal(SIGUSR2, inner);
  signal(SIGHUP, outer);
  signal(SIGTERM, leaving);
  struct sigaction old;
  int own = sigaction(SIGUSR1, NULL, &old) == 0 && old.sa_sigaction == with_info &&
            (old.sa_flags & SA_SIGINFO) && signal(SIGUSR2, inner) == inner &&
            signal(SIGHUP, outer) == outer;
  raise(SIGUSR1);
  raise(SIGHUP);
  int jumped = 0;
  for (int round = 0; round < 3; round++) {
    if (sigsetjmp(back, 1) == 0)
      raise(SIGTERM);
    else
      jumped++;
  }
  printf("%ld %s %d %s\n", sink, pc_in_libc == 1 ? "pc-in-libc" : "pc-elsewhere", jumped,
         own ? "own-handlers" : "foreign-handlers");
  return 0;
}
