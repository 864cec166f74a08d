/* A program that reaps its children in a SIGCHLD handler, as shells and servers do; this one
   also formats a line there on a large buffer.  Three threads call g() in a loop; after
   "ready", `sigchld N` runs for N tenths of a second, then forks a child that exits 7, which
   the handler reaps, and prints the total of g's arguments and the status it reaped. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile long sink;
static volatile int reaped = -1;

static void on_chld(int sig) {
  char line[16384];
  int saved = errno, status;
  (void)sig;
  while (waitpid(-1, &status, WNOHANG) > 0) {
    snprintf(line, sizeof line, "reaped %d", status);
    reaped = WEXITSTATUS(status) + (line[0] != 'r');
  }
  errno = saved;
}

__attribute__((noinline)) void g(long i) { __atomic_fetch_add(&sink, i, __ATOMIC_RELAXED); }

static volatile int stop;

static void *worker(void *arg) {
  (void)arg;
  while (!stop) {
    for (long i = 0; i < 1000; i++) g(1);
    usleep(1000);
  }
  return NULL;
}

int main(int argc, char **argv) {
  int tenths = argc > 1 ? atoi(argv[1]) : 10;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_chld;
  sa.sa_flags = SA_RESTART;
  sigaction(SIGCHLD, &sa, NULL);
  pthread_t t[3];
  for (int i = 0; i < 3; i++) pthread_create(&t[i], NULL, worker, NULL);
  printf("ready\n");
  fflush(stdout);
  usleep(tenths * 100000);
  stop = 1;
  for (int i = 0; i < 3; i++) pthread_join(t[i], NULL);
  pid_t child = fork();
  if (child == 0) _exit(7);
  while (reaped < 0) usleep(1000);
  printf("%d %s\n", reaped, sink > 0 ? "called" : "idle");
  return 0;
}
