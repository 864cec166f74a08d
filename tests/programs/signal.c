/* A signal handler that calls f: raise(SIGUSR1) three times, f is called 3 times from it.
   With "wait": the handler set, says "ready" and reads a line first (to be attached to). */
#include <signal.h>
#include <stdio.h>
#include <string.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }
static void handler(int sig) { f(sig); }

int main(int argc, char **argv) {
  signal(SIGUSR1, handler);
  if (argc > 1 && strcmp(argv[1], "wait") == 0) {
    char line[8];
    puts("ready");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
      return 1;
  }
  for (int i = 0; i < 3; i++) raise(SIGUSR1);
  printf("%ld\n", sink);
  return 0;
}
