/* Three threads; thread i calls g exactly 5 + 2*i times: small enough to single-step. */
#include <pthread.h>
#include <stdio.h>

volatile long sink;
__attribute__((noinline)) void g(int i) { sink += i; }

static void *worker(void *arg) {
  int n = 5 + 2 * (int)(long)arg;
  for (int i = 0; i < n; i++) g(i);
  return NULL;
}

int main(void) {
  pthread_t t[3];
  for (long i = 0; i < 3; i++) pthread_create(&t[i], NULL, worker, (void *)i);
  for (int i = 0; i < 3; i++) pthread_join(t[i], NULL);
  printf("%ld\n", sink);
  return 0;
}
