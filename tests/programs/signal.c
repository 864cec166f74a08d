/* A signal handler that calls f: raise(SIGUSR1) three times, f is called 3 times from it. */
#include <signal.h>
#include <stdio.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }
static void handler(int sig) { f(sig); }

int main(void) {
  signal(SIGUSR1, handler);
  for (int i = 0; i < 3; i++) raise(SIGUSR1);
  printf("%ld\n", sink);
  return 0;
}
