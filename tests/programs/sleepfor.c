/* `sleepfor SECONDS [seccomp]`: (with `seccomp`, under a seccomp filter that allows every
   system call) says "ready", sleeps SECONDS in one nanosleep(), then reads a line
   from stdin, and prints how long the sleep took in milliseconds and the line read
   ("slept 3000 ms, read: hello").  An attach target stopped inside a system call: the
   sleep and the read must go on as if nothing had stopped them. */
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
  struct timespec want = {argc > 1 ? atoi(argv[1]) : 3, 0}, a, b;
  char line[64] = {0};
  if (argc > 2 && strcmp(argv[2], "seccomp") == 0) {
    struct sock_filter allow = BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    struct sock_fprog filter = {1, &allow};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &filter))
      return 2;
  }
  printf("ready %d\n", getpid());
  fflush(stdout);
  clock_gettime(CLOCK_MONOTONIC, &a);
  nanosleep(&want, NULL);
  clock_gettime(CLOCK_MONOTONIC, &b);
  ssize_t n = read(0, line, sizeof line - 1);
  long ms = (b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000;
  printf("slept %ld ms, read: %s", ms, n > 0 ? line : "(nothing)\n");
  return 0;
}
