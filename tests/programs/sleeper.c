/* Calls f, then sleeps, 20 times: at least 20 context switches out and back in. */
#include <stdio.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

int main(void) {
  for (int i = 0; i < 20; i++) {
    f(i);
    usleep(2000);
  }
  printf("%ld\n", sink);
  return 0;
}
