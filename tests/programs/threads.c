/* Four threads; thread i calls g exactly COUNTS[i] times (distinct primes). */
#include <pthread.h>
#include <stdio.h>

static const int COUNTS[4] = {1009, 2003, 3001, 4001};
volatile long sink;

__attribute__((noinline)) void g(int i) { sink += i; }

static void *worker(void *arg) {
  int n = COUNTS[(long)arg];
  for (int i = 0; i < n; i++) g(i);
  return NULL;
}

int main(void) {
  pthread_t t[4];
  for (long i = 0; i < 4; i++) pthread_create(&t[i], NULL, worker, (void *)i);
  for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  printf("%ld\n", sink);
  return 0;
}
