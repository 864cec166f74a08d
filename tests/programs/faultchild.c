/* Stands for a child that faults in Frida's recovery from its fork() while Frida's injector
   traces it: forks a child that, once a line comes on stdin, writes through a NULL pointer;
   prints the child's pid, waits for it, then prints how it ended ("signal N" or "exit N"). */
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

int main(void) {
  pid_t child = fork();
  if (child == 0) {
    char line[8];
    if (fgets(line, sizeof line, stdin))
      *(volatile int *)0 = 1;
    _exit(0);
  }
  printf("%d\n", child);
  fflush(stdout);
  int status;
  waitpid(child, &status, 0);
  if (WIFSIGNALED(status))
    printf("signal %d\n", WTERMSIG(status));
  else
    printf("exit %d\n", WEXITSTATUS(status));
  return 0;
}
