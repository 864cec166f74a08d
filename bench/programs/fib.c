/* Recursive fib: calls and returns, nothing else. */
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) long fib(int n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }
int main(int argc, char **argv) {
  printf("%ld\n", fib(argc > 1 ? atoi(argv[1]) : 30));
  return 0;
}
