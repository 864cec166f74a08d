/* An attach target that forks: says "ready", waits START_MS milliseconds (0), then ROUNDS
   times (40), PAUSE_US microseconds (50000) apart, forks a child that calls f exactly 7
   times and exits 0; prints how many children exited 0. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 40;
  int pause_us = argc > 2 ? atoi(argv[2]) : 50000;
  int start_ms = argc > 3 ? atoi(argv[3]) : 0;
  printf("ready %d\n", getpid());
  fflush(stdout);
  usleep(start_ms * 1000);
  int ok = 0;
  for (int round = 0; round < rounds; round++) {
    pid_t child = fork();
    if (child == 0) {
      for (int i = 0; i < 7; i++) f(i);
      _exit(0);
    }
    int status;
    waitpid(child, &status, 0);
    ok += WIFEXITED(status) && WEXITSTATUS(status) == 0;
    usleep(pause_us);
  }
  printf("%d\n", ok);
  return 0;
}
