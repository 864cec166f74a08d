/* One signal at a time, each waited for: the main thread does some work (calls, and
   globals read and written through rip-relative operands, which Stalker's copy relocates
   into several instructions each) and then reads a byte from a pipe; a second thread sends
   it SIGUSR1 at a varying point of that work, waits until the handler has run, and only
   then writes the byte.  A signal the tracer kept back past the read(), or lost, would
   leave both waiting (alarm() ends that after 10 s).  With `siginfo` the handler is
   SA_SIGINFO and the signal comes from pthread_sigqueue() with the round's number, which
   the handler checks with the siginfo's code.  Prints the rounds, the handler runs, the
   runs whose siginfo was not the one sent, and a checksum. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int fds[2], with_info;
static pthread_t main_thread;
static volatile long round_started, handled, wrong, sink;
static long rounds;

__attribute__((noinline)) void f(long x) { sink += x ^ (sink >> 3); }
static void on_signal(int sig) { handled++; }
static void on_signal_info(int sig, siginfo_t *info, void *uc) {
  if (info->si_code != SI_QUEUE || info->si_value.sival_int != (int)round_started)
    wrong++;
  handled++;
}

/* With two CPUs or more allowed, the threads each on one of their own (the nth allowed):
   sharing one, the sender spins only once the main thread sleeps in read(), and every
   signal came there. */
static cpu_set_t allowed; /* the process's, read before either thread is pinned */

static void pin_to(pthread_t thread, int nth) {
  cpu_set_t one;
  if (CPU_COUNT(&allowed) < 2)
    return;
  for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
    if (CPU_ISSET(cpu, &allowed) && nth-- == 0) {
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      pthread_setaffinity_np(thread, sizeof one, &one);
      return;
    }
}

static void *sender(void *arg) {
  pin_to(pthread_self(), 1);
  unsigned seed = 1;
  for (long i = 1; i <= rounds; i++) {
    while (round_started != i)
      sched_yield();
    seed = seed * 1103515245 + 12345;
    for (volatile unsigned spin = (seed >> 16) % 5000; spin > 0; spin--)
      ;
    if (with_info)
      pthread_sigqueue(main_thread, SIGUSR1, (union sigval){.sival_int = (int)i});
    else
      pthread_kill(main_thread, SIGUSR1);
    while (handled != i)
      sched_yield();
    if (write(fds[1], "x", 1) != 1)
      exit(2);
  }
  return NULL;
}

int main(int argc, char **argv) {
  rounds = argc > 1 ? atol(argv[1]) : 1000;
  with_info = argc > 2 && strcmp(argv[2], "siginfo") == 0;
  struct sigaction sa = {0};
  if (with_info)
    sa.sa_sigaction = on_signal_info;
  else
    sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART | (with_info ? SA_SIGINFO : 0);
  sigaction(SIGUSR1, &sa, NULL);
  if (pipe(fds) != 0)
    return 2;
  alarm(10);
  main_thread = pthread_self();
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0)
    CPU_ZERO(&allowed);
  pin_to(main_thread, 0);
  pthread_t t;
  pthread_create(&t, NULL, sender, NULL);
  char byte;
  for (long i = 1; i <= rounds; i++) {
    round_started = i;
    for (long k = 0; k < 3000; k++)
      f(k + i);
    if (read(fds[0], &byte, 1) != 1)
      return 3;
  }
  pthread_join(t, NULL);
  printf("%ld %ld %ld %ld\n", rounds, handled, wrong, sink);
  return 0;
}
