/* One thread forks ROUNDS (argv[1], 30) children, 1 ms apart, each calling f 3 times and
   exiting 0, while main starts and joins short threads (each calls g once) without pause --
   but never while a fork() is under way: a mutex keeps each fork() apart from a thread's
   whole life.  So a fork() meets no thread starting or ending, only the messages a new
   thread's ring causes between the recorder and Frida's agent (docs/fork.md section 17).
   Prints "OK of ROUNDS children ok, N threads"; exits 0 if every child exited 0. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(long i) { sink += i; }
__attribute__((noinline)) void g(long i) { sink -= i; }

static int rounds = 30, ok, done;
static pthread_mutex_t apart = PTHREAD_MUTEX_INITIALIZER;

static void *forker(void *arg) {
  (void)arg;
  for (int r = 0; r < rounds; r++) {
    pthread_mutex_lock(&apart);
    pid_t child = fork();
    if (child == 0) {
      for (long i = 0; i < 3; i++) f(i);
      _exit(0);
    }
    pthread_mutex_unlock(&apart);
    int status;
    if (child > 0 && waitpid(child, &status, 0) == child && status == 0)
      ok++;
    else
      fprintf(stderr, "round %d: child %d status %#x\n", r, child, status);
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
  }
  __atomic_store_n(&done, 1, __ATOMIC_SEQ_CST);
  return NULL;
}

static void *brief(void *arg) {
  g((long)arg);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc > 1) rounds = atoi(argv[1]);
  pthread_t t;
  pthread_create(&t, NULL, forker, NULL);
  long started = 0;
  while (!__atomic_load_n(&done, __ATOMIC_SEQ_CST)) {
    pthread_t b;
    pthread_mutex_lock(&apart);
    if (pthread_create(&b, NULL, brief, (void *)started) == 0) {
      pthread_join(b, NULL);
      started++;
    }
    pthread_mutex_unlock(&apart);
  }
  pthread_join(t, NULL);
  printf("%d of %d children ok, %ld threads\n", ok, rounds, started);
  return ok == rounds ? 0 : 1;
}
