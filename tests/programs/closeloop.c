/* An attach target that closes a file every millisecond: says "ready", then until a line
   comes on stdin, every millisecond closes a copy of its stdin and calls f; then prints how
   many times. */
#include <poll.h>
#include <stdio.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

int main(void) {
  printf("ready %d\n", getpid());
  fflush(stdout);
  int rounds = 0;
  struct pollfd input = {.fd = 0, .events = POLLIN};
  while (poll(&input, 1, 1) == 0) {
    close(dup(0));
    f(rounds++);
  }
  printf("%d\n", rounds);
  return 0;
}
