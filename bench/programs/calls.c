/* A tight call loop. */
#include <stdio.h>
#include <stdlib.h>
volatile long sink;
__attribute__((noinline)) void f(long i) { sink += i; }
int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 30000000;
  for (long i = 0; i < n; i++) f(i);
  printf("%ld\n", sink);
  return 0;
}
