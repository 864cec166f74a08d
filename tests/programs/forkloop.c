/* An attach target that forks: says "ready", then 40 times, 50 ms apart, forks a child
   that calls f exactly 7 times and exits 0; prints how many children exited 0. */
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

int main(void) {
  printf("ready %d\n", getpid());
  fflush(stdout);
  int ok = 0;
  for (int round = 0; round < 40; round++) {
    pid_t child = fork();
    if (child == 0) {
      for (int i = 0; i < 7; i++) f(i);
      _exit(0);
    }
    int status;
    waitpid(child, &status, 0);
    ok += WIFEXITED(status) && WEXITSTATUS(status) == 0;
    usleep(50000);
  }
  printf("%d\n", ok);
  return 0;
}
