/* Stands for BtState's fork() counters -- held, in flight, passing, gated -- in a process
   with a fork() under way (its in-flight count at 1): prints their address, then waits. */
#include <stdio.h>
#include <unistd.h>

volatile int counters[5] = {0, 1, 0, 0, 0}; /* one more 0, for a view shifted by one */

int main(void) {
  printf("%p\n", (void *)counters);
  fflush(stdout);
  for (;;)
    pause();
}
