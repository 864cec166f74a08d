/* What a thread runs after its start routine: its thread_local destructors (registered as
   C++ registers them, with __cxa_thread_atexit_impl), its pthread key destructors, then
   libc's own cleanup, up to the exit system call.  Each worker's thread_local destructor
   calls step() twice and its key destructor 3 times; worker 0 returns, worker 1 calls
   pthread_exit().
   `threadend key-crash`: one worker, whose key destructor faults in its third step().
   `threadend late`: one worker; 0.6 s after it ended, main calls later().
   `threadend churn N`: N threads one after another, then one more that takes a signal
   (SIGUSR1, with a handler); then the program prints how many KiB of branchtrace's rings
   (*.bts files) it still has mapped.
   `threadend exit N`: one worker calls step() and then sleeps; main calls exit(N) (exit_group)
   once it is asleep, which ends the worker where it is. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern void *__dso_handle;
int __cxa_thread_atexit_impl(void (*dtor)(void *), void *obj, void *dso_symbol);

static pthread_key_t key;
static int table[4] = {1, 2, 3, 4};
static int faulting_step = -1;
static volatile int sum;

__attribute__((noinline)) static void step(int i) {
  sum += table[i == faulting_step ? 1 << 28 : i];
}

static void on_tls_end(void *arg) {
  step(0);
  step(1);
}

static void on_key_end(void *arg) {
  for (int i = 0; i < 3; i++)
    step(i);
}

static void *worker(void *arg) {
  __cxa_thread_atexit_impl(on_tls_end, arg, &__dso_handle);
  pthread_setspecific(key, arg);
  if ((long)arg == 2)
    pthread_exit(NULL);
  return NULL;
}

static void *nothing(void *arg) { return arg; }

__attribute__((noinline)) static void later(void) { step(3); }

static volatile sig_atomic_t signals;

static void on_usr1(int sig) { signals++; }

static void *signalled(void *arg) {
  raise(SIGUSR1);
  step(0);
  return arg;
}

static volatile int asleep;

static void *sleeper(void *arg) {
  step(0);
  asleep = 1;
  for (;;)
    pause();
  return arg;
}

static long rings_mapped_kib(void) {
  FILE *maps = fopen("/proc/self/maps", "r");
  char line[4096];
  long kib = 0;
  while (fgets(line, sizeof line, maps)) {
    unsigned long start, end;
    size_t n = strlen(line);
    if (n > 5 && strcmp(line + n - 5, ".bts\n") == 0 && sscanf(line, "%lx-%lx", &start, &end) == 2)
      kib += (long)((end - start) / 1024);
  }
  fclose(maps);
  return kib;
}

int main(int argc, char **argv) {
  pthread_t t;
  if (argc > 2 && strcmp(argv[1], "churn") == 0) {
    for (int i = atoi(argv[2]); i > 0; i--) {
      pthread_create(&t, NULL, nothing, NULL);
      pthread_join(t, NULL);
    }
    signal(SIGUSR1, on_usr1);
    pthread_create(&t, NULL, signalled, NULL);
    pthread_join(t, NULL);
    printf("rings mapped: %ld KiB\n", rings_mapped_kib());
    return 0;
  }
  if (argc > 2 && strcmp(argv[1], "exit") == 0) {
    pthread_create(&t, NULL, sleeper, NULL);
    while (!asleep)
      usleep(1000);
    usleep(20000); /* into pause() */
    exit(atoi(argv[2]));
  }
  pthread_key_create(&key, on_key_end);
  int crash = argc > 1 && strcmp(argv[1], "key-crash") == 0;
  int late = argc > 1 && strcmp(argv[1], "late") == 0;
  if (crash)
    faulting_step = 2;
  for (long i = 1; i <= (crash || late ? 1 : 2); i++) { /* non-NULL: its destructor runs */
    pthread_create(&t, NULL, worker, (void *)i);
    pthread_join(t, NULL);
  }
  if (late) {
    usleep(600000);
    later();
  }
  puts("done");
  return 0;
}
