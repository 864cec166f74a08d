/* A handler set before a fork(): parent and child each raise SIGUSR1 three times, and the
   handler calls f.  Prints each one's sum. */
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>
volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }
static void handler(int sig) { f(sig); }
int main(void) {
  signal(SIGUSR1, handler);
  pid_t pid = fork();
  for (int i = 0; i < 3; i++) raise(SIGUSR1);
  if (pid == 0) { printf("child %ld\n", sink); return 0; }
  int status; waitpid(pid, &status, 0);
  printf("parent %ld\n", sink);
  return 0;
}
