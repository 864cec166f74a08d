/* cflags: -O2 -g -fno-inline
   Tail calls: at -O2, is_even/is_odd end in `jmp` to each other and mid ends in `jmp leaf`.
   is_even(10) enters the pair 11 times; mid is called 4 times. */
#include <stdio.h>

volatile int sink;
__attribute__((noinline)) int is_odd(unsigned n);
__attribute__((noinline)) int is_even(unsigned n) { return n == 0 ? 1 : is_odd(n - 1); }
__attribute__((noinline)) int is_odd(unsigned n) { return n == 0 ? 0 : is_even(n - 1); }
__attribute__((noinline)) int leaf(int x) { sink += x; return x * 3 + 1; }
__attribute__((noinline)) int mid(int x) { return leaf(x + 1); }

int main(void) {
  int r = is_even(10);
  for (int i = 0; i < 4; i++) r += mid(i);
  printf("%d\n", r);
  return 0;
}
