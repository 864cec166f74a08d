/* 8 threads call probed() 10,000 times each: exact per-thread hit counts. */
#include <pthread.h>
#include <stdio.h>

#define THREADS 8
#define CALLS 10000

__attribute__((noinline)) long probed(long i, const char *who) {
  asm volatile("");
  return i + who[0];
}

static void *worker(void *arg) {
  long sum = 0;
  for (long i = 0; i < CALLS; i++) sum += probed(i, "worker");
  *(long *)arg = sum;
  return NULL;
}

int main(void) {
  pthread_t t[THREADS];
  long sums[THREADS];
  for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, worker, &sums[i]);
  long total = 0;
  for (int i = 0; i < THREADS; i++) {
    pthread_join(t[i], NULL);
    total += sums[i];
  }
  printf("total %ld\n", total);
  return 0;
}
