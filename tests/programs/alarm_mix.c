/* Timer signals over a mix of program and libc code (sorting with a comparator, formatting,
   string functions, recursion), so that they land in record sequences written through many
   different registers: argv[1] rounds while SIGALRM fires every 20 us.  Prints a checksum,
   the comparator's call count, and how many handler runs interrupted the main thread. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

volatile long main_ticks, compares;
static pid_t main_tid;
static void on_alarm(int sig) {
  if (gettid() == main_tid)
    main_ticks++;
}

__attribute__((noinline)) int by_value(const void *a, const void *b) {
  compares++;
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

__attribute__((noinline)) long fib(int n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }

int main(int argc, char **argv) {
  long rounds = atol(argv[1]);
  main_tid = gettid();
  signal(SIGALRM, on_alarm);
  struct itimerval every = {{0, 20}, {0, 20}}, off = {{0, 0}, {0, 0}};
  setitimer(ITIMER_REAL, &every, NULL);
  unsigned long sum = 0, seed = 7;
  int values[500];
  char text[256];
  for (long r = 0; r < rounds; r++) {
    for (int i = 0; i < 500; i++)
      values[i] = (int)((seed = seed * 6364136223846793005UL + 1442695040888963407UL) >> 40);
    qsort(values, 500, sizeof values[0], by_value);
    int n = snprintf(text, sizeof text, "%ld:%d:%d:%x:%s", r, values[0], values[499], values[250],
                     r % 2 ? "odd" : "even");
    sum += (unsigned long)n + strlen(text) + (unsigned long)(strchr(text, ':') - text);
    sum += (unsigned long)fib(12) + (unsigned long)values[100];
  }
  setitimer(ITIMER_REAL, &off, NULL);
  printf("%lu %ld %ld\n", sum, compares, main_ticks);
  return 0;
}
