/* An attach target that forks the moment its fork() calls are routed elsewhere (the stalker
   agent points fork()'s GOT slot at its fork stub as it loads): says "ready", watches the
   GOT slot its calls of fork() go through (the one fork@plt jumps through), and as soon as it
   changes calls fork(), with a pthread_atfork prepare handler that sleeps
   PREPARE_MS (1000) first, so the agent goes on loading while this fork() is under way.
   Then ROUNDS (10) more forks, 50 ms apart, each without the sleep.  Each child calls f 3
   times and exits 0; the parent calls f once per fork.  Prints how many children exited 0
   and how many times it called f; exits 2 if the slot did not change within 60 s, 3 if fork@plt is not as expected. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

static long prepare_ms = 1000;

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, ms % 1000 * 1000 * 1000};
  nanosleep(&ts, NULL);
}

static void slow_prepare(void) {
  if (prepare_ms > 0)
    sleep_ms(prepare_ms);
}

int main(int argc, char **argv) {
  if (argc > 1)
    prepare_ms = atol(argv[1]);
  int rounds = argc > 2 ? atoi(argv[2]) : 10;
  unsigned char *plt;
  __asm__("lea fork@PLT(%%rip), %0" : "=r"(plt));
  if (plt[0] != 0xff || plt[1] != 0x25) /* jmp *disp32(%rip) */
    return 3;
  void *volatile *slot = (void *volatile *)(plt + 6 + *(int *)(plt + 2));
  void *native = *slot;
  pthread_atfork(slow_prepare, NULL, NULL);
  printf("ready %d\n", getpid());
  fflush(stdout);
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  while (*slot == native) {
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec - start.tv_sec > 60)
      return 2;
  }
  int ok = 0, calls = 0;
  for (int round = 0; round <= rounds; round++) {
    pid_t child = fork();
    if (child == 0) {
      for (int i = 0; i < 3; i++)
        f(i);
      _exit(0);
    }
    prepare_ms = 0;
    int status;
    waitpid(child, &status, 0);
    ok += WIFEXITED(status) && WEXITSTATUS(status) == 0;
    f(round);
    calls++;
    sleep_ms(50);
  }
  printf("%d %d\n", ok, calls);
  return 0;
}
