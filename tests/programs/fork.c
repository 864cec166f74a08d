/* The parent calls f 3 times after fork, the child 5 times. */
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

int main(void) {
  pid_t child = fork();
  int n = child == 0 ? 5 : 3;
  for (int i = 0; i < n; i++) f(i);
  if (child == 0) {
    printf("child %ld\n", sink);
    return 0;
  }
  int status;
  waitpid(child, &status, 0);
  printf("parent %ld child-status %d\n", sink, WEXITSTATUS(status));
  return 0;
}
