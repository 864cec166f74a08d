/* THREADS (200) threads started and joined one after another: the mean time from
   pthread_create() to the thread's first line (its start), and from its last line to the
   end of pthread_join() (its end). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static double entered, left;

static void *worker(void *arg) {
  entered = now();
  left = now();
  return arg;
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 200;
  double start = 0, end = 0;
  for (int i = 0; i < n; i++) {
    pthread_t t;
    double created = now();
    pthread_create(&t, NULL, worker, NULL);
    pthread_join(t, NULL);
    start += entered - created;
    end += now() - left;
  }
  printf("%.3f %.3f\n", start / n * 1e3, end / n * 1e3);
  return 0;
}
