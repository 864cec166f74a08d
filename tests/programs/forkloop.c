/* An attach target that forks: says "ready", waits START_MS milliseconds (0; -1: until a
   line on stdin), then ROUNDS times (40), PAUSE_US microseconds (50000) apart, forks a child
   that calls f exactly 7 times, lives CHILD_US microseconds more (0) and exits 0 (through
   _exit(), or through exit() as a shell's subshell does with EXIT "exit"), and calls
   round_done once it has waited for it; prints how many children exited 0, and on stderr
   how each other one ended. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }
__attribute__((noinline)) void round_done(int round) { sink += round; }

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 40;
  int pause_us = argc > 2 ? atoi(argv[2]) : 50000;
  int start_ms = argc > 3 ? atoi(argv[3]) : 0;
  int child_us = argc > 4 ? atoi(argv[4]) : 0;
  int run_exit_handlers = argc > 5 && strcmp(argv[5], "exit") == 0;
  printf("ready %d\n", getpid());
  fflush(stdout);
  if (start_ms < 0)
    getchar();
  else
    usleep(start_ms * 1000);
  int ok = 0;
  for (int round = 0; round < rounds; round++) {
    pid_t child = fork();
    if (child == 0) {
      for (int i = 0; i < 7; i++) f(i);
      usleep(child_us);
      if (run_exit_handlers)
        exit(0);
      _exit(0);
    }
    int status;
    waitpid(child, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
      ok++;
    else if (WIFSIGNALED(status))
      fprintf(stderr, "forkloop: child %d (round %d) killed by signal %d\n", child, round,
              WTERMSIG(status));
    else
      fprintf(stderr, "forkloop: child %d (round %d) exited with status %d\n", child, round,
              WEXITSTATUS(status));
    round_done(round);
    usleep(pause_us);
  }
  printf("%d\n", ok);
  return 0;
}
