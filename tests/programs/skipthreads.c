/* N threads (in waves of 8, N a multiple of 8), each of which faults once in poke() under
   a SA_SIGINFO handler that moves its pc on to resumed(), which calls after() and ends the
   thread; then "after N".  The first fault of each thread is the first time its handler
   leaves elsewhere, while the other threads of its wave start: what a thread needs to be
   followed again from there is made then. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define WAVE 8

static volatile int done;
static int *volatile nowhere;

__attribute__((noinline)) void poke(int *p) { *p = 42; }
__attribute__((noinline)) void after(void) { __sync_fetch_and_add(&done, 1); }

/* ends its thread by the system call: pthread_exit() would unwind through a frame the
   handler made up */
__attribute__((noinline, noreturn)) void resumed(void) {
  after();
  syscall(SYS_exit, 0);
  __builtin_unreachable();
}

static void on_segv(int sig, siginfo_t *info, void *context) {
  ((ucontext_t *)context)->uc_mcontext.gregs[REG_RIP] = (greg_t)resumed;
}

static void *run(void *unused) {
  poke(nowhere);
  return NULL;
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : WAVE;
  struct sigaction act = {.sa_sigaction = on_segv, .sa_flags = SA_SIGINFO};
  sigaction(SIGSEGV, &act, NULL);
  for (int i = 0; i < n; i += WAVE) {
    pthread_t threads[WAVE];
    for (int k = 0; k < WAVE; k++)
      pthread_create(&threads[k], NULL, run, NULL);
    for (int k = 0; k < WAVE; k++)
      pthread_join(threads[k], NULL);
  }
  printf("after %d\n", done);
  return 0;
}
