/* An attach target whose threads loop in code Stalker compiles once: THREADS (8) threads,
   half of them calling f in a busy loop, half calling f and usleep(100), until a line comes
   on stdin.  Says "ready PID" first; at the end prints "ok" and the total of the calls if
   every thread's count matches the sum it kept. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static volatile int stop;

struct worker {
  pthread_t thread;
  int sleepy;
  long calls, sum;
};

__attribute__((noinline)) long f(long i) { return i & 7; }

static void *work(void *arg) {
  struct worker *w = arg;
  while (!stop) {
    w->sum += f(w->calls++);
    if (w->sleepy)
      usleep(100);
  }
  return NULL;
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 8;
  struct worker *w = calloc(n, sizeof *w);
  for (int i = 0; i < n; i++) {
    w[i].sleepy = i % 2;
    pthread_create(&w[i].thread, NULL, work, &w[i]);
  }
  printf("ready %d\n", getpid());
  fflush(stdout);
  getchar();
  stop = 1;
  long total = 0;
  int ok = 1;
  for (int i = 0; i < n; i++) {
    pthread_join(w[i].thread, NULL);
    long expect = (w[i].calls / 8) * 28;
    for (long c = w[i].calls / 8 * 8; c < w[i].calls; c++) expect += c & 7;
    ok &= w[i].sum == expect;
    total += w[i].calls;
  }
  printf("%s %ld\n", ok ? "ok" : "wrong", total);
  return 0;
}
