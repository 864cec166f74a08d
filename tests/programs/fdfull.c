/* Uses up its file descriptors (under a limit of 64), then starts a thread that calls f
   exactly 7 times; frees them and prints "ok" and the sum f was given. */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/resource.h>
#include <unistd.h>

volatile int sink;
__attribute__((noinline)) void f(int i) { sink += i; }

static void *worker(void *arg) {
  for (int i = 0; i < 7; i++) f(i);
  return arg;
}

int main(void) {
  struct rlimit limit = {64, 64};
  setrlimit(RLIMIT_NOFILE, &limit);
  int fds[64], n = 0;
  while (n < 64 && (fds[n] = open("/dev/null", O_RDONLY)) >= 0) n++;
  pthread_t t;
  pthread_create(&t, NULL, worker, NULL);
  pthread_join(t, NULL);
  while (n > 0) close(fds[--n]);
  printf("ok %d\n", sink);
  return 0;
}
