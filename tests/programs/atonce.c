/* Two signals at once, every round: SIGUSR1 and SIGUSR2 made pending while blocked, then
   unblocked by one sigprocmask(), so that the kernel delivers both as it returns from it:
   SIGUSR1's frame first, then SIGUSR2's on top, at SIGUSR1's handler's first instruction,
   whose handler so runs first.  Prints how many rounds ran SIGUSR2's handler first, and
   how many handler runs there were. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>

static volatile int ran[2];
static volatile long usr2_first, runs;

__attribute__((noinline)) static void on_usr1(int sig) {
  if (ran[1] && !ran[0])
    usr2_first++;
  ran[0] = 1;
  runs++;
}

__attribute__((noinline)) static void on_usr2(int sig) {
  ran[1] = 1;
  runs++;
}

int main(int argc, char **argv) {
  long rounds = argc > 1 ? atol(argv[1]) : 100;
  signal(SIGUSR1, on_usr1);
  signal(SIGUSR2, on_usr2);
  sigset_t both;
  sigemptyset(&both);
  sigaddset(&both, SIGUSR1);
  sigaddset(&both, SIGUSR2);
  for (long i = 0; i < rounds; i++) {
    ran[0] = ran[1] = 0;
    sigprocmask(SIG_BLOCK, &both, NULL);
    raise(SIGUSR1);
    raise(SIGUSR2);
    sigprocmask(SIG_UNBLOCK, &both, NULL);
  }
  printf("%ld %ld\n", usr2_first, runs);
  return 0;
}
