/* An attach target that is nearly always inside fork(): a pthread_atfork prepare handler
   (run by fork() itself) sleeps 100 ms (or argv[1] ms).  Says "ready", then 20 times (or
   argv[2] times) forks a child that calls f 3 times and exits 0, and calls f once itself;
   prints how many children exited 0 and how many times it called f. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

static long prepare_ms = 100;

static void slow_prepare(void) {
  struct timespec ts = {prepare_ms / 1000, prepare_ms % 1000 * 1000 * 1000};
  nanosleep(&ts, NULL);
}

int main(int argc, char **argv) {
  if (argc > 1)
    prepare_ms = atol(argv[1]);
  int rounds = argc > 2 ? atoi(argv[2]) : 20;
  pthread_atfork(slow_prepare, NULL, NULL);
  printf("ready %d\n", getpid());
  fflush(stdout);
  int ok = 0, calls = 0;
  for (int round = 0; round < rounds; round++) {
    pid_t child = fork();
    if (child == 0) {
      for (int i = 0; i < 3; i++) f(i);
      _exit(0);
    }
    int status;
    waitpid(child, &status, 0);
    ok += WIFEXITED(status) && WEXITSTATUS(status) == 0;
    f(round);
    calls++;
  }
  printf("%d %d\n", ok, calls);
  return 0;
}
