/* A child stuck the way a shell's subshell forked while Frida's agent unloads is
   (engines/forkwindow.py): asleep in exit() on the C library's lock of its list of exit
   handlers, which a thread the child does not have held at the fork (Frida's, running the
   agent's handlers in __cxa_finalize as it unloads).  Here a second thread walks that list
   over and over, as __cxa_finalize() of a library with no handlers in it does, holding the
   lock.  Says "ready", and when a line comes on stdin forks children that exit(0) until one
   has not ended 200 ms later (5,000 at most): says "child PID" (0: none stuck) and waits for
   it, then prints its wait status. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern void __cxa_finalize(void *dso);

static volatile int walking = 1;

static void handler(void) {}

static void *walker(void *arg) {
  while (walking)
    __cxa_finalize((void *)1); /* no handler belongs to that "library" */
  return arg;
}

static int ended_within(pid_t child, int ms, int *status) {
  struct timespec tick = {0, 1000000};
  for (int i = 0; i < ms; i++) {
    if (waitpid(child, status, WNOHANG) == child)
      return 1;
    nanosleep(&tick, NULL);
  }
  return 0;
}

int main(void) {
  for (int i = 0; i < 20000; i++)
    atexit(handler);
  pthread_t thread;
  pthread_create(&thread, NULL, walker, NULL);
  char line[8];
  printf("ready\n");
  fflush(stdout);
  if (!fgets(line, sizeof line, stdin))
    return 2;
  pid_t stuck = 0;
  int status = 0;
  for (int round = 0; round < 5000 && stuck == 0; round++) {
    pid_t child = fork();
    if (child == 0)
      exit(0);
    if (!ended_within(child, 200, &status))
      stuck = child;
  }
  walking = 0;
  pthread_join(thread, NULL);
  printf("child %d\n", stuck);
  fflush(stdout);
  if (stuck == 0)
    return 1;
  waitpid(stuck, &status, 0);
  printf("status %d\n", status);
  fflush(stdout);
  _exit(0); /* not through the 20,000 handlers */
}
