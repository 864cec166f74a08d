/* Closing every fd but 0-2 (argv[2]: "close_range", or "close" on each up to 1023), as
   Python's subprocess and GLib's spawn do in a child before its exec, and daemons as they
   start.  argv[1] says who does it:
     child    a forked child, before it calls exec (/bin/true)
     program  the program itself, before it calls work() 100 times and forks
   With argv[3] = "full", it first uses up its fds (under a limit of 64), as a program that
   ran out of them and closes them all would.  Then a forked child calls work() once and
   exits with status 7. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <sys/resource.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;
static volatile int sum;

__attribute__((noinline)) static void work(int i) { sum += i; }

static void close_all(const char *how, int full) {
  if (full) {
    struct rlimit limit = {64, 64};
    setrlimit(RLIMIT_NOFILE, &limit);
    while (open("/dev/null", O_RDONLY) >= 0)
      ;
  }
  if (strcmp(how, "close_range") == 0)
    syscall(SYS_close_range, 3, ~0U, 0);
  else
    for (int fd = 3; fd < 1024; fd++)
      close(fd);
}

int main(int argc, char **argv) {
  if (argc < 3)
    return 2;
  int full = argc > 3 && strcmp(argv[3], "full") == 0;
  int status = -1;
  if (strcmp(argv[1], "child") == 0) {
    pid_t pid = fork();
    if (pid == 0) {
      close_all(argv[2], full);
      char *child_argv[] = {"/bin/true", NULL};
      execve(child_argv[0], child_argv, environ);
      _exit(127);
    }
    waitpid(pid, &status, 0);
    if (status != 0)
      return 3;
  } else {
    close_all(argv[2], full);
  }
  for (int i = 0; i < 100; i++)
    work(i);
  pid_t pid = fork();
  if (pid == 0) {
    work(0);
    _exit(7);
  }
  waitpid(pid, &status, 0);
  printf("sum %d child %d\n", sum, WEXITSTATUS(status));
  return 0;
}
