/* f called N times (argv[1]): about three blocks per iteration. */
#include <stdio.h>
#include <stdlib.h>

volatile long sink;
__attribute__((noinline)) void f(long i) { sink += i; }

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 1000;
  for (long i = 0; i < n; i++) f(i);
  printf("%ld\n", sink);
  return 0;
}
