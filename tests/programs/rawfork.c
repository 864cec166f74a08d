/* Children forked past Frida's fork() hook, by the fork system call itself: the first
   calls f 7 times and exits 3, the second kills itself with SIGSEGV; then a child forked
   by fork() calls f 7 times and exits 0.  The parent waits for each and prints the three
   pids. */
#include <signal.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

static void calls(void) {
  for (int i = 0; i < 7; i++) f(i);
}

int main(void) {
  long exits = syscall(SYS_fork);
  if (exits == 0) {
    calls();
    _exit(3);
  }
  waitpid(exits, NULL, 0);
  long faults = syscall(SYS_fork);
  if (faults == 0) {
    calls();
    kill(getpid(), SIGSEGV);
    _exit(4);
  }
  waitpid(faults, NULL, 0);
  pid_t hooked = fork();
  if (hooked == 0) {
    calls();
    _exit(0);
  }
  waitpid(hooked, NULL, 0);
  printf("%ld %ld %d\n", exits, faults, hooked);
  return 0;
}
