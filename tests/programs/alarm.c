/* Timer signals that land at arbitrary instructions: calls f argv[1] times while SIGALRM
   fires every 20 us (every argv[2] us if given); prints the sum, how many times the
   handler ran, and how many of those runs interrupted the main thread; then, for each of
   those, how many calls of f had begun by then (`at`, or one fewer).  The others ran on a
   thread the program did not create: the kernel gives a process-directed signal to any
   thread not blocking it when the main thread already has one pending, and a tracer's
   agent threads count. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <unistd.h>

#define MAX_TICKS (1 << 20)
volatile long sink, main_ticks, at;
static long other_ticks; /* runs on other threads, which may run it at once: counted atomically */
static long at_tick[MAX_TICKS];
static pid_t main_tid;
__attribute__((noinline)) void f(long i) { sink += i; }
static void on_alarm(int sig) {
  if (gettid() != main_tid)
    __atomic_fetch_add(&other_ticks, 1, __ATOMIC_RELAXED);
  else if (main_ticks < MAX_TICKS)
    at_tick[main_ticks++] = at;
}

int main(int argc, char **argv) {
  long n = atol(argv[1]);
  main_tid = gettid();
  signal(SIGALRM, on_alarm);
  long us = argc > 2 ? atol(argv[2]) : 20; /* the timer's period */
  struct itimerval every = {{0, us}, {0, us}}, off = {{0, 0}, {0, 0}};
  setitimer(ITIMER_REAL, &every, NULL);
  for (long i = 0; i < n; i++) {
    at = i + 1;
    f(i);
  }
  setitimer(ITIMER_REAL, &off, NULL);
  /* A signal sent before that may still be pending, or its handler still running on another
     thread: the recorder counts each run, so the pending one is dropped and the running ones
     waited for before the counts are read (3 runs of 203,273 counted after the printout,
     once in 30 recordings) */
  signal(SIGALRM, SIG_IGN);
  usleep(20000);
  printf("%ld %ld %ld\n", sink, main_ticks + __atomic_load_n(&other_ticks, __ATOMIC_RELAXED),
         main_ticks);
  for (long k = 0; k < main_ticks; k++)
    printf("%ld ", at_tick[k]);
  printf("\n");
  return 0;
}
