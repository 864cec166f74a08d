/* Moves to the directory DIR (argv[1]), then starts a thread that calls f exactly 29 times,
   as a daemon that changes to / before it starts its workers. */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

volatile int sink;
__attribute__((noinline)) void f(int i) { sink += i; }

static void *worker(void *arg) {
  for (int i = 0; i < 29; i++) f(i);
  return arg;
}

int main(int argc, char **argv) {
  if (argc < 2 || chdir(argv[1]) != 0) {
    perror("chdir");
    return 2;
  }
  pthread_t t;
  pthread_create(&t, NULL, worker, NULL);
  pthread_join(t, NULL);
  printf("%d\n", sink);
  return 0;
}
