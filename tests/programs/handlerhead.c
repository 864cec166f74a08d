/* cflags: -O2 -g -fno-inline
   A signal handler that begins with a conditional jump (`cmp edi, 10; je`, at -O2): the
   first bytes, which the agent's hook on the handler's entry replaces, are run relocated
   by Frida's trampoline, so that a jump taken there shows only as the handler's next
   block.  ROUNDS (argv[1], 6) times main raises SIGUSR1 or SIGUSR2 in turn; prints how
   many runs took each way. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>

volatile long usr1, other;

void handler(int sig) {
  if (sig == SIGUSR1)
    usr1++;
  else
    other++;
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 6;
  signal(SIGUSR1, handler);
  signal(SIGUSR2, handler);
  for (int i = 0; i < rounds; i++)
    raise(i % 2 ? SIGUSR1 : SIGUSR2);
  printf("%ld %ld\n", usr1, other);
  return 0;
}
