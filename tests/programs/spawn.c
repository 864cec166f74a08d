/* A child that runs a program, then after() 3 times: the program's own code after the
   child's exec.  How the child is made (argv[1]):
     (none)    posix_spawn(): a child that shares this memory until it calls exec
     system    system("exit 3"), whose /bin/sh is such a child too
     popen     popen("exit 3"), the same
     vfork     vfork(), the child calling in_child() 5 times before its exec
     failexec  no child: an exec of this program that fails, and the program runs on
   With argv[2] = N, it prints "spawned" once the child is done and calls after(1) N more
   times (a recorder to kill meanwhile). */
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;
static volatile int sum;
static volatile int child_calls; /* vfork: shared with the child, so not printed */

__attribute__((noinline)) static void after(int i) { sum += i; }
__attribute__((noinline)) static void in_child(int i) { child_calls += i; }

int main(int argc, char **argv) {
  const char *how = argc > 1 ? argv[1] : "posix_spawn";
  char *child_argv[] = {"/bin/true", NULL};
  pid_t pid = -1;
  int status = -1;
  if (strcmp(how, "posix_spawn") == 0) {
    if (posix_spawn(&pid, child_argv[0], NULL, NULL, child_argv, environ) != 0)
      return 2;
  } else if (strcmp(how, "system") == 0) {
    status = system("exit 3");
  } else if (strcmp(how, "popen") == 0) {
    FILE *f = popen("exit 3", "r");
    if (f == NULL)
      return 2;
    status = pclose(f);
  } else if (strcmp(how, "vfork") == 0) {
    pid = vfork();
    if (pid == 0) {
      for (int i = 0; i < 5; i++)
        in_child(i);
      execve(child_argv[0], child_argv, environ);
      _exit(127);
    }
  } else if (strcmp(how, "failexec") == 0) {
    execve("/nonexistent/program", child_argv, environ);
    status = 0;
  } else {
    return 2;
  }
  if (pid > 0)
    waitpid(pid, &status, 0);
  for (int i = 1; i <= 3; i++)
    after(i);
  if (argc > 2) {
    puts("spawned");
    fflush(stdout);
    for (long n = atol(argv[2]); n > 0; n--)
      after(1);
  }
  printf("child %d sum %d\n", WEXITSTATUS(status), sum);
  return 0;
}
