/* Calls through a table of function pointers: 20 indirect calls, 5 to each of 4 functions. */
#include <stdio.h>

__attribute__((noinline)) static long add(long a, long b) { return a + b; }
__attribute__((noinline)) static long sub(long a, long b) { return a - b; }
__attribute__((noinline)) static long mul(long a, long b) { return a * (b % 3 + 1); }
__attribute__((noinline)) static long neg(long a, long b) { return -a + b; }

long (*const ops[4])(long, long) = {add, sub, mul, neg};

int main(void) {
  long acc = 1;
  for (int i = 0; i < 20; i++) acc = ops[i % 4](acc, i);
  printf("%ld\n", acc);
  return 0;
}
