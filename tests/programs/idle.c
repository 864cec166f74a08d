/* An attach target that goes idle: says "ready", waits for a line, calls f exactly 5 times,
   sleeps SECONDS (8), says "woke", sleeps 2 s more, says whether it has a signal stack
   ("signal stack: none") and "done". */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

int main(int argc, char **argv) {
  int seconds = argc > 1 ? atoi(argv[1]) : 8;
  printf("ready %d\n", getpid());
  fflush(stdout);
  getchar();
  for (int i = 0; i < 5; i++) f(i);
  sleep(seconds);
  puts("woke");
  fflush(stdout);
  sleep(2);
  stack_t ss;
  sigaltstack(NULL, &ss);
  printf("signal stack: %s\n", ss.ss_flags & SS_DISABLE ? "none" : "set");
  puts("done");
  return 0;
}
