/* A forked child whose threads fork at the same moment: the program forks a child, which
   (GENERATIONS, argv[3], 1, above 1) forks the next generation, and so on.  In the last
   generation THREADS (argv[1], 4) threads meet, wait 200 ms (no fork() meets a thread
   starting), then ROUNDS (argv[2], 5) times meet at a barrier and each fork a child that
   calls f exactly i + 2 times (i: the thread's index) and exits 0, and waits for it.  That
   generation prints, for each thread, how many of its children exited 0, and exits 0 if
   all did; each parent waits for its child and exits with its status. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(long i) { sink += i; }

static int rounds = 5;
static int ok[64];
static pthread_barrier_t together;

static void *forker(void *arg) {
  long index = (long)arg;
  pthread_barrier_wait(&together);
  usleep(200000);
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
  }
  return NULL;
}

static int forking_child(int threads) {
  pthread_barrier_init(&together, NULL, threads);
  pthread_t t[64];
  for (long i = 0; i < threads; i++) pthread_create(&t[i], NULL, forker, (void *)i);
  int all = 1;
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < threads; i++) {
    printf(i ? " %d" : "%d", ok[i]);
    all &= ok[i] == rounds;
  }
  printf("\n");
  fflush(stdout);
  return all ? 0 : 1;
}

static int parent_of(int generations, int threads) {
  pid_t child = fork();
  if (child == 0)
    _exit(generations > 1 ? parent_of(generations - 1, threads) : forking_child(threads));
  int status;
  if (waitpid(child, &status, 0) != child) return 3;
  if (!WIFEXITED(status)) fprintf(stderr, "child %d status %#x\n", child, status);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 4;
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 4;
  if (argc > 2) rounds = atoi(argv[2]);
  int generations = argc > 3 ? atoi(argv[3]) : 1;
  if (threads < 1 || threads > 64 || generations < 1) return 2;
  return parent_of(generations, threads);
}
