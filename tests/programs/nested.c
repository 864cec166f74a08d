/* Forks a child that forks a grandchild: the grandchild calls f exactly 7 times and lives
   CHILD_US microseconds (200000) more; once it has exited, its parent waits 300 ms and calls
   after exactly 5 times, and so does the top process.  With a 2nd argument: says "ready" and
   waits for a line first (an attach target).  Prints "nested 0" when all exited 0, and
   how each child that did not ended. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }
__attribute__((noinline)) void after(int i) { sink += i; }

static int run(int depth, int child_us) {
  if (depth == 0) {
    for (int i = 0; i < 7; i++) f(i);
    usleep(child_us);
    return 0;
  }
  pid_t kid = fork();
  if (kid == 0)
    _exit(run(depth - 1, child_us));
  int status;
  waitpid(kid, &status, 0);
  if (status != 0) { /* how it ended, for a test that fails */
    printf("depth %d: child %d status %#x\n", depth, kid, status);
    fflush(stdout);
  }
  usleep(300000);
  for (int i = 0; i < 5; i++) after(i);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

int main(int argc, char **argv) {
  int child_us = argc > 1 ? atoi(argv[1]) : 200000;
  if (argc > 2) {
    printf("ready %d\n", getpid());
    fflush(stdout);
    getchar();
  }
  int rc = run(2, child_us);
  printf("nested %d\n", rc);
  return rc;
}
