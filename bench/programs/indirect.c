/* Indirect calls through a table of function pointers. */
#include <stdio.h>
#include <stdlib.h>
volatile long sink;
__attribute__((noinline)) static void a(long i) { sink += i; }
__attribute__((noinline)) static void b(long i) { sink -= i; }
__attribute__((noinline)) static void c(long i) { sink ^= i; }
__attribute__((noinline)) static void d(long i) { sink += 2 * i; }
static void (*const table[4])(long) = {a, b, c, d};
int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 20000000;
  for (long i = 0; i < n; i++) table[(i * 7) & 3](i);
  printf("%ld\n", sink);
  return 0;
}
