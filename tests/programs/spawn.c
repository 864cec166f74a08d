/* posix_spawn() (a child that shares this memory until it calls exec), then after() 3
   times: the program's own code after the child's exec. */
#include <spawn.h>
#include <stdio.h>
#include <sys/wait.h>

extern char **environ;
static volatile int sum;

__attribute__((noinline)) static void after(int i) { sum += i; }

int main(void) {
  pid_t pid;
  char *argv[] = {"/bin/true", NULL};
  int status = -1;
  if (posix_spawn(&pid, argv[0], NULL, NULL, argv, environ) == 0)
    waitpid(pid, &status, 0);
  for (int i = 1; i <= 3; i++)
    after(i);
  printf("child %d sum %d\n", status, sum);
  return 0;
}
