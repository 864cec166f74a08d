/* Forked children that get the same pid: forks children one after another, each of which
   calls f exactly 7 times and exits with its number (0, 1, ...), the parent waiting for
   each, and before each after the first sets the last pid handed out
   (/proc/sys/kernel/ns_last_pid: root only) to one below the first child's, until a child
   gets the pid of an earlier one (at most 50 children; another thread may take the pid
   first).  Prints "reused" or "not reused", and exits 0. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

static pid_t child(int number) {
  pid_t pid = fork();
  if (pid == 0) {
    for (int i = 0; i < 7; i++) f(i);
    _exit(number);
  }
  waitpid(pid, NULL, 0);
  return pid;
}

int main(void) {
  pid_t pids[50];
  pids[0] = child(0);
  for (int n = 1; n < 50; n++) {
    FILE *last = fopen("/proc/sys/kernel/ns_last_pid", "w");
    if (last == NULL || fprintf(last, "%d", pids[0] - 1) < 0 || fclose(last) != 0)
      break;
    pids[n] = child(n);
    for (int earlier = 0; earlier < n; earlier++)
      if (pids[earlier] == pids[n]) {
        puts("reused");
        return 0;
      }
  }
  puts("not reused");
  return 0;
}
