/* Forks ROUNDS (argv[1], 3) children; its pthread_atfork() parent handler, which runs inside
   each fork() after the child is made, starts and joins a thread that calls g once.  Each
   child calls f 3 times and exits 0.  Prints "OK of ROUNDS children ok"; exits 0 if every
   child exited 0.  Under --follow-fork a fork() waits for the threads being started; this
   one is started by the fork()'s own thread (bt_on_pthread_create in stalker_agent.c). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(long i) { sink += i; }
__attribute__((noinline)) void g(long i) { sink -= i; }

static void *helper(void *arg) {
  g((long)arg);
  return NULL;
}

static void in_parent(void) {
  pthread_t t;
  if (pthread_create(&t, NULL, helper, (void *)1) == 0)
    pthread_join(t, NULL);
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 3, ok = 0;
  pthread_atfork(NULL, in_parent, NULL);
  for (int r = 0; r < rounds; r++) {
    pid_t child = fork();
    if (child == 0) {
      for (long i = 0; i < 3; i++)
        f(i);
      _exit(0);
    }
    int status;
    if (child > 0 && waitpid(child, &status, 0) == child && status == 0)
      ok++;
  }
  printf("%d of %d children ok\n", ok, rounds);
  return ok == rounds ? 0 : 1;
}
