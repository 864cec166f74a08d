/* A burst of calls the test can hold the recorder's drain away from: says "ready", waits for
   a line, calls fib(N) (N = argv[1], 26), says "done" and waits for another line before it
   exits.  fib is called exactly 2*fib(N+1)-1 times. */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) long fib(int n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 26;
  puts("ready");
  fflush(stdout);
  getchar();
  printf("done %ld\n", fib(n));
  fflush(stdout);
  getchar();
  return 0;
}
