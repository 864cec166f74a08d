/* main -> a -> boom, which writes through a NULL pointer; with an argument N, N calls of
   tick first (enough to go round a small ring several times). */
#include <stdio.h>
#include <stdlib.h>

volatile long ticks;
__attribute__((noinline)) void tick(long i) { ticks += i; }
__attribute__((noinline)) void boom(int *p) { *p = 42; }
__attribute__((noinline)) void a(int *p) { boom(p); }

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 0;
  for (long i = 0; i < n; i++)
    tick(i);
  puts("about to crash");
  fflush(stdout);
  a(NULL);
  return 0;
}
