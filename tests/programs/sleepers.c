/* An attach target whose threads sleep in different system calls: says "ready", waits for
   a line, starts seven threads that block -- read() on a pipe, poll() that times out after
   SECONDS + 0.5 s, pthread_cond_wait(), nanosleep() for SECONDS + 0.5 s, epoll_wait() on a
   pipe without a timeout, epoll_wait() that times out after 3 * SECONDS, semop() --
   sleeps SECONDS (3) itself, then wakes the reader, the waiter, the first epoll thread and
   the semop thread.  Each thread checks what its call returned (never EINTR) and how long
   it slept, and prints "ok NAME" or "bad NAME: why"; the program exits 0 only if all seven
   are ok. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/sem.h>
#include <time.h>
#include <unistd.h>

static double seconds = 3;
static int reader_pipe[2], poll_pipe[2], epoll_pipe[2], quiet_pipe[2];
static int semaphore;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static int told;
static int bad;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void result(const char *name, int ok, const char *why) {
  pthread_mutex_lock(&lock);
  if (ok)
    printf("ok %s\n", name);
  else {
    printf("bad %s: %s (%s)\n", name, why, strerror(errno));
    bad = 1;
  }
  fflush(stdout);
  pthread_mutex_unlock(&lock);
}

static void *reader(void *arg) {
  char buf[8] = {0};
  ssize_t n = read(reader_pipe[0], buf, sizeof buf);
  result("read", n == 5 && memcmp(buf, "hello", 5) == 0, "not hello");
  return arg;
}

static void *poller(void *arg) {
  struct pollfd p = {poll_pipe[0], POLLIN, 0};
  double start = now();
  int r = poll(&p, 1, (int)((seconds + 0.5) * 1000));
  double slept = now() - start;
  result("poll", r == 0 && slept >= seconds + 0.45, "not a whole timeout");
  return arg;
}

static void *waiter(void *arg) {
  pthread_mutex_lock(&lock);
  while (!told)
    pthread_cond_wait(&cond, &lock);
  pthread_mutex_unlock(&lock);
  result("cond", 1, "");
  return arg;
}

static void *sleeper(void *arg) {
  double want = seconds + 0.5;
  struct timespec ts = {(time_t)want, (long)((want - (time_t)want) * 1e9)};
  double start = now();
  int r = nanosleep(&ts, NULL);
  double slept = now() - start;
  result("nanosleep", r == 0 && slept >= want - 0.05, "cut short");
  return arg;
}

static void *epoller(void *arg) {
  int ep = epoll_create1(0);
  struct epoll_event ev = {EPOLLIN, {0}}, got;
  epoll_ctl(ep, EPOLL_CTL_ADD, epoll_pipe[0], &ev);
  int r = epoll_wait(ep, &got, 1, -1);
  result("epoll", r == 1, "no event");
  return arg;
}

static void *epoll_timer(void *arg) {
  int ep = epoll_create1(0);
  struct epoll_event ev = {EPOLLIN, {0}}, got;
  epoll_ctl(ep, EPOLL_CTL_ADD, quiet_pipe[0], &ev);
  double start = now();
  int r = epoll_wait(ep, &got, 1, (int)(3 * seconds * 1000));
  double slept = now() - start;
  result("epoll-timeout", r == 0 && slept >= 3 * seconds - 0.05, "not a whole timeout");
  return arg;
}

static void *semaphore_waiter(void *arg) {
  struct sembuf down = {0, -1, 0};
  int r = semop(semaphore, &down, 1);
  result("semop", r == 0, "not taken");
  return arg;
}

int main(int argc, char **argv) {
  if (argc > 1)
    seconds = atof(argv[1]);
  if (pipe(reader_pipe) || pipe(poll_pipe) || pipe(epoll_pipe) || pipe(quiet_pipe))
    return 2;
  semaphore = semget(IPC_PRIVATE, 1, 0600);
  if (semaphore < 0)
    return 2;
  printf("ready %d\n", getpid());
  fflush(stdout);
  getchar();
  void *(*bodies[])(void *) = {reader,  poller,      waiter,          sleeper,
                                epoller, epoll_timer, semaphore_waiter};
  enum { N = sizeof bodies / sizeof bodies[0] };
  pthread_t threads[N];
  for (int i = 0; i < N; i++)
    pthread_create(&threads[i], NULL, bodies[i], NULL);
  usleep((useconds_t)(seconds * 1e6));
  struct sembuf up = {0, 1, 0};
  if (write(reader_pipe[1], "hello", 5) != 5 || write(epoll_pipe[1], "x", 1) != 1 ||
      semop(semaphore, &up, 1) != 0)
    return 2;
  pthread_mutex_lock(&lock);
  told = 1;
  pthread_cond_signal(&cond);
  pthread_mutex_unlock(&lock);
  for (int i = 0; i < N; i++)
    pthread_join(threads[i], NULL);
  semctl(semaphore, 0, IPC_RMID);
  return bad;
}
