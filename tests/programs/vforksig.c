/* ROUNDS (argv[1], 40) times vfork() a child that exits at once, with a SIGCHLD handler
   set: the child's exit releases the parent and sends it SIGCHLD, which comes as the
   parent's vfork() returns, mostly.  Prints "ROUNDS rounds, N signals" (N: the handler's
   runs, fewer than ROUNDS when two came together). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink, caught;
__attribute__((noinline)) void f(long i) { sink += i; }
void on_child(int sig) { caught += sig == SIGCHLD; }

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 40;
  signal(SIGCHLD, on_child);
  for (int r = 0; r < rounds; r++) {
    f(r);
    pid_t pid = vfork();
    if (pid == 0)
      _exit(0);
    int status = -1;
    while (pid > 0 && waitpid(pid, &status, 0) != pid)
      ;
    if (status != 0)
      return 1;
  }
  printf("%d rounds, %ld signals\n", rounds, caught);
  return 0;
}
