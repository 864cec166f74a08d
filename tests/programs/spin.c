/* A target to attach to: says "ready", then calls f every 2 ms, 1500 times -- about 3
   seconds -- and prints the sum of 0..1499.  With "until-told", it goes on until a line comes
   on stdin and prints how many times it called f and the sum: an attach that takes long
   under load cannot find it gone. */
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

int main(int argc, char **argv) {
  int until_told = argc > 1 && strcmp(argv[1], "until-told") == 0;
  printf("ready %d\n", getpid());
  fflush(stdout);
  int rounds = 0;
  struct pollfd input = {.fd = 0, .events = POLLIN};
  while (until_told ? poll(&input, 1, 2) == 0 : rounds < 1500) {
    f(rounds++);
    if (!until_told)
      usleep(2000);
  }
  if (until_told)
    printf("%d %ld\n", rounds, sink);
  else
    printf("%ld\n", sink);
  return 0;
}
