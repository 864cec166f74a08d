/* cflags: -O0 -g -fno-inline -fno-omit-frame-pointer -Wl,-z,now
   (bound at load: which thread first calls read() through the PLT, and so goes through
   the lazy binder, is the threads' race)
   A thread cancelled while it waits in read() (a cancellation point): main starts it,
   waits until it has called f(2) and is about to block, and cancels it.  glibc delivers
   SIGCANCEL, whose handler (glibc's own) unwinds the thread, running its cleanup handler,
   which calls f(1).  Prints 1 if the thread ended cancelled. */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(long i) { sink += i; }
static void cleanup(void *arg) { f((long)arg); }
static int ready[2], never[2];

static void *waiter(void *arg) {
  (void)arg;
  char c = 0;
  pthread_cleanup_push(cleanup, (void *)1);
  f(2);
  if (write(ready[1], &c, 1) == 1)
    for (;;)
      if (read(never[0], &c, 1) <= 0)
        break;
  pthread_cleanup_pop(0);
  return NULL;
}

int main(void) {
  if (pipe(ready) || pipe(never))
    return 2;
  pthread_t t;
  char c;
  pthread_create(&t, NULL, waiter, NULL);
  if (read(ready[0], &c, 1) != 1)
    return 2;
  usleep(20000); /* into its read() */
  pthread_cancel(t);
  void *result;
  pthread_join(t, &result);
  printf("%d\n", result == PTHREAD_CANCELED);
  return 0;
}
