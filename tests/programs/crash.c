/* main -> a -> boom, which writes through a NULL pointer. */
#include <stdio.h>

__attribute__((noinline)) void boom(int *p) { *p = 42; }
__attribute__((noinline)) void a(int *p) { boom(p); }

int main(void) {
  puts("about to crash");
  fflush(stdout);
  a(NULL);
  return 0;
}
