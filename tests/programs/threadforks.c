/* THREADS (argv[1], 4) threads fork at the same moment, ROUNDS (argv[2], 5) times: each
   round they meet at a barrier, then each forks a child that calls f exactly i + 2 times
   (i: the thread's index) and exits 0, and waits for it.  Then main prints, for each
   thread, how many of its children exited 0.  The threads first meet and wait 200 ms, so
   that no fork() meets a thread starting (docs/fork.md section 15: that is a hazard of its
   own under --follow-fork).  With argv[3], the threads are started first, main prints
   "ready PID", and they fork only once that file exists (a recorder attaches meanwhile),
   each round followed by 1 ms of sleep ("-": none).  With GENERATIONS (argv[4], 0), the
   program first forks a child, which forks the next generation, and so on: the last one
   does all this, and each parent waits for its child and exits with its status. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(long i) { sink += i; }

static int rounds = 5;
static int ok[64];
static pthread_barrier_t together;
static const char *go;

static void *forker(void *arg) {
  long index = (long)arg;
  if (go != NULL) {
    while (access(go, F_OK) != 0) usleep(1000);
  } else {
    pthread_barrier_wait(&together);
    usleep(200000);
  }
  for (int r = 0; r < rounds; r++) {
    pthread_barrier_wait(&together);
    pid_t child = fork();
    if (child == 0) {
      for (long i = 0; i < index + 2; i++) f(i);
      _exit(0);
    }
    int status;
    if (child > 0 && waitpid(child, &status, 0) == child && status == 0)
      ok[index]++;
    else
      fprintf(stderr, "thread %ld round %d: child %d status %#x\n", index, r, child, status);
    if (go != NULL) {
      struct timespec ms = {0, 1000000};
      nanosleep(&ms, NULL);
    }
  }
  return NULL;
}

/* Returns in the last of `generations` forked generations; exits in the others. */
static void fork_generations(int generations) {
  for (; generations > 0; generations--) {
    pid_t child = fork();
    if (child == 0)
      continue;
    int status;
    if (waitpid(child, &status, 0) != child) exit(3);
    if (!WIFEXITED(status)) fprintf(stderr, "child %d status %#x\n", child, status);
    exit(WIFEXITED(status) ? WEXITSTATUS(status) : 4);
  }
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 4;
  if (argc > 2) rounds = atoi(argv[2]);
  if (argc > 3 && argv[3][0] != '-') go = argv[3];
  int generations = argc > 4 ? atoi(argv[4]) : 0;
  if (threads < 1 || threads > 64 || generations < 0) return 2;
  fork_generations(generations);
  pthread_barrier_init(&together, NULL, threads);
  pthread_t t[64];
  for (long i = 0; i < threads; i++) pthread_create(&t[i], NULL, forker, (void *)i);
  if (go != NULL) {
    printf("ready %d\n", getpid());
    fflush(stdout);
  }
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < threads; i++) printf(i ? " %d" : "%d", ok[i]);
  printf("\n");
  return 0;
}
