/* Four threads; thread i calls g exactly COUNTS[i] times (distinct primes).
   `threads N`: N waves of four such threads, each wave started together once the one before
   has ended. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static const int COUNTS[4] = {1009, 2003, 3001, 4001};
long sink;

/* atomic: threads of a wave run g at the same time */
__attribute__((noinline)) void g(int i) { __atomic_fetch_add(&sink, i, __ATOMIC_RELAXED); }

static void *worker(void *arg) {
  int n = COUNTS[(long)arg];
  for (int i = 0; i < n; i++) g(i);
  return NULL;
}

int main(int argc, char **argv) {
  int waves = argc > 1 ? atoi(argv[1]) : 1;
  for (int w = 0; w < waves; w++) {
    pthread_t t[4];
    for (long i = 0; i < 4; i++) pthread_create(&t[i], NULL, worker, (void *)i);
    for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  }
  printf("%ld\n", sink);
  return 0;
}
