/* setuid() in a threaded process: glibc sends SIGSETXID, whose handler it sets with the
   system call itself, to every thread it knows, so that each changes its credentials.
   Two threads run meanwhile, one calling f() without pause, one sleeping 1 ms at a time;
   main calls setuid(getuid()) ROUNDS (argv[1], 5) times, then stops them.  Prints "ok". */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

volatile long sink;
volatile int stop;
__attribute__((noinline)) void f(long i) { sink += i; }

static void *spinner(void *arg) {
  (void)arg;
  while (!stop)
    f(1);
  return NULL;
}

static void *sleeper(void *arg) {
  (void)arg;
  while (!stop)
    usleep(1000);
  return NULL;
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 5;
  pthread_t a, b;
  pthread_create(&a, NULL, spinner, NULL);
  pthread_create(&b, NULL, sleeper, NULL);
  usleep(50000);
  for (int i = 0; i < rounds; i++)
    if (setuid(getuid()) != 0)
      return 1;
  stop = 1;
  pthread_join(a, NULL);
  pthread_join(b, NULL);
  printf("ok\n");
  return 0;
}
