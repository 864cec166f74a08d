/* `slowhandler N`: says "ready", then raises SIGALRM, whose handler sleeps for 3 s and calls
   h(); then main calls g() N times and prints N.  A recorder that attaches while the
   handler runs begins following the thread inside it: the handler's return (rt_sigreturn)
   must not take the thread out of the trace. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

volatile long sink;
__attribute__((noinline)) void g(long i) { sink += i; }
__attribute__((noinline)) void h(void) { sink++; }

static void on_alarm(int sig) {
  (void)sig;
  struct timespec left = {3, 0};
  while (nanosleep(&left, &left) != 0)
    ;
  h();
}

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 1000;
  signal(SIGALRM, on_alarm);
  printf("ready\n");
  fflush(stdout);
  raise(SIGALRM);
  for (long i = 0; i < n; i++)
    g(i);
  printf("%ld\n", n);
  return 0;
}
