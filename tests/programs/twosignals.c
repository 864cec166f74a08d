/* Two signals at once: 4 threads make calls while a 20 kHz SIGALRM goes to the process and
   each thread sends SIGUSR1 to the next every 500 rounds, so that now and then both are
   pending as a thread goes back to user space and the kernel delivers them together (the
   second one's frame on top of the first one's, at its handler's entry).  Prints the sum of
   the threads' results. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <sys/time.h>

#define THREADS 4
static pthread_t threads[THREADS];
static volatile int go;
static volatile long ticks;
__attribute__((noinline)) long g(long x) { return x * 3 + 1; }
__attribute__((noinline)) long f(long x) { return g(x) ^ (x >> 1); }
static void on_signal(int sig) { ticks++; }

static void *work(void *arg) {
  long me = (long)arg, acc = 0;
  while (!go)
    ;
  for (long i = 0; i < 100000; i++) {
    acc += f(i);
    if (i % 500 == 0)
      pthread_kill(threads[(me + 1) % THREADS], SIGUSR1);
  }
  return (void *)acc;
}

int main(void) {
  signal(SIGALRM, on_signal);
  signal(SIGUSR1, on_signal);
  struct itimerval every = {{0, 50}, {0, 50}}, off = {{0, 0}, {0, 0}};
  setitimer(ITIMER_REAL, &every, NULL);
  for (long i = 0; i < THREADS; i++)
    pthread_create(&threads[i], NULL, work, (void *)i);
  go = 1;
  long total = 0;
  for (int i = 0; i < THREADS; i++) {
    void *result;
    pthread_join(threads[i], &result);
    total += (long)result;
  }
  setitimer(ITIMER_REAL, &off, NULL);
  printf("%ld\n", total);
  return 0;
}
