/* A target to attach to: says "ready", then calls f for about 3 seconds. */
#include <stdio.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

int main(void) {
  printf("ready %d\n", getpid());
  fflush(stdout);
  for (int i = 0; i < 1500; i++) {
    f(i);
    usleep(2000);
  }
  printf("%ld\n", sink);
  return 0;
}
