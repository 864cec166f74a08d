/* Four threads, each a call loop. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
static long per_thread;
__attribute__((noinline)) static long g(long i) { return i & 7; }
static void *worker(void *arg) {
  long acc = 0;
  for (long i = 0; i < per_thread; i++) acc += g(i);
  *(long *)arg = acc;
  return NULL;
}
int main(int argc, char **argv) {
  per_thread = (argc > 1 ? atol(argv[1]) : 40000000) / 4;
  pthread_t t[4];
  long acc[4];
  for (int i = 0; i < 4; i++) pthread_create(&t[i], NULL, worker, &acc[i]);
  for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  printf("%ld\n", acc[0] + acc[1] + acc[2] + acc[3]);
  return 0;
}
