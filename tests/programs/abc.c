/* main -> a -> b -> c: the smallest known call chain. */
#include <stdio.h>

__attribute__((noinline)) int c(int x) { return x * 3; }
__attribute__((noinline)) int b(int x) { return c(x + 1) + 1; }
__attribute__((noinline)) int a(int x) { return b(x * 2); }

int main(void) {
  printf("%d\n", a(5));
  return 0;
}
