/* Forks CHILDREN (argv[1], 3) children one after another; each starts 3 threads one after
   another, and thread i of it calls f exactly 5 + i times, then the child exits 0.  The
   parent waits for each and prints "done". */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(long i) { sink += i; }

static void *worker(void *arg) {
  for (long i = 0; i < 5 + (long)arg; i++) f(i);
  return NULL;
}

int main(int argc, char **argv) {
  int children = argc > 1 ? atoi(argv[1]) : 3;
  for (int c = 0; c < children; c++) {
    pid_t pid = fork();
    if (pid == 0) {
      for (long i = 0; i < 3; i++) {
        pthread_t t;
        pthread_create(&t, NULL, worker, (void *)i);
        pthread_join(t, NULL);
      }
      _exit(0);
    }
    int status;
    if (waitpid(pid, &status, 0) != pid || status != 0) return 1;
  }
  puts("done");
  return 0;
}
