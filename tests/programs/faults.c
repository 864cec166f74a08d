/* A fault of each kind, for traces that end at the faulting instruction.  MODE:
   segv   poke() writes through NULL          bus    peek() reads a page past a file's end
   fpe    divide() divides by zero            ill    trap() runs ud2
   abort  give_up() calls abort()
   int3   an int3 instruction                 raise  raise(SIGSEGV): sent, not a fault
   recover  poke() faults 3 times under a SIGSEGV handler that siglongjmps back to main,
            which prints "recovered 3" and returns 0
   where  poke() faults under a SA_SIGINFO handler that says whether the interrupted pc it
          is given lies in poke ("fault in poke"), then exits 3
   A second argument: "wait" prints "ready" and reads a line first; "child" has a forked
   child fault, and prints how it ended ("child: signal N" or "child: exit N"). */
#define _GNU_SOURCE
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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

static void on_segv(int sig) { siglongjmp(back, sig); }

static void on_segv_where(int sig, siginfo_t *info, void *context) {
  ucontext_t *uc = context;
  unsigned long pc = (unsigned long)uc->uc_mcontext.gregs[REG_RIP];
  unsigned long at = (unsigned long)poke;
  printf("fault %s poke\n", pc >= at && pc < at + 32 ? "in" : "not in");
  fflush(stdout);
  _exit(3);
}

static int fault(const char *mode);

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "segv";
  const char *how = argc > 2 ? argv[2] : "";
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
    struct sigaction act = {.sa_sigaction = on_segv_where, .sa_flags = SA_SIGINFO};
    sigaction(SIGSEGV, &act, NULL);
    poke(NULL);
  }
  if (!strcmp(mode, "recover")) {
    signal(SIGSEGV, on_segv);
    int recovered = 0;
    for (int i = 0; i < 3; i++)
      if (sigsetjmp(back, 1) == 0)
        poke(NULL);
      else
        recovered++;
    printf("recovered %d\n", recovered);
    return 0;
  }
  return 1;
}
