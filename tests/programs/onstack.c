/* A SIGUSR1 handler registered with SA_ONSTACK by a program that sets no signal stack, so
   that natively it runs on the thread's stack, where it uses 1 MiB.  Raised in main and in
   a thread; prints "handled 2". */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

static volatile int handled;

static void on_usr1(int sig) {
  char big[1024 * 1024];
  memset(big, 1, sizeof big);
  handled += big[sizeof big - 1];
}

static void *in_thread(void *unused) {
  raise(SIGUSR1);
  return NULL;
}

int main(void) {
  struct sigaction act = {.sa_handler = on_usr1, .sa_flags = SA_ONSTACK};
  sigaction(SIGUSR1, &act, NULL);
  raise(SIGUSR1);
  pthread_t thread;
  pthread_create(&thread, NULL, in_thread, NULL);
  pthread_join(thread, NULL);
  printf("handled %d\n", handled);
  return 0;
}
