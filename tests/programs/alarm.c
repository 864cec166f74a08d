/* Timer signals that land at arbitrary instructions: calls f argv[1] times while SIGALRM
   fires every 20 us; prints the sum and how many times the handler ran. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>

volatile long sink, ticks;
__attribute__((noinline)) void f(long i) { sink += i; }
static void on_alarm(int sig) { ticks++; }

int main(int argc, char **argv) {
  long n = atol(argv[1]);
  signal(SIGALRM, on_alarm);
  struct itimerval every = {{0, 20}, {0, 20}}, off = {{0, 0}, {0, 0}};
  setitimer(ITIMER_REAL, &every, NULL);
  for (long i = 0; i < n; i++)
    f(i);
  setitimer(ITIMER_REAL, &off, NULL);
  printf("%ld %ld\n", sink, ticks);
  return 0;
}
