/* main -> a -> boom, writing through NULL (after N ticks; a 2nd arg: "ready", a line) */
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) void boom(int *p) { *p = 42; }
__attribute__((noinline)) void a(int *p) { boom(p); }

/* enough calls to go round a small ring several times before the crash */
volatile long ticks;
__attribute__((noinline)) void tick(long i) { ticks += i; }

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 0;
  if (argc > 2) {
    puts("ready");
    fflush(stdout);
    getchar();
  }
  for (long i = 0; i < n; i++)
    tick(i);
  puts("about to crash");
  fflush(stdout);
  a(NULL);
  return 0;
}
