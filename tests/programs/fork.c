/* The parent calls f 3 times after fork, the child 5 times.
   `fork rings`: a second thread of the parent waits on a pipe as the program forks; the
   child prints "child PID: N rings" (N: the *.bts files it has mapped that are not named
   for its own thread, such as its parent's threads' rings), then the first such line of
   its /proc/self/maps, if any.
   `fork rings DIR`: the same, then the child closes its output, so that a recording ends
   with its parent, and waits (up to 60 s) for DIR/go before it calls f; it writes DIR/done
   at its end.
   `fork code`: sets a SIGBUS handler, prints "parent: N changed code pages" and forks; the
   child prints "child: N changed code pages, M fault handlers not its own" (N: pages of the
   executable mappings of files whose bytes are no longer the file's, such as a hooked
   function's first page; M: of SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT, SIGTRAP and
   SIGSYS, those whose handler is neither the default nor its SIGBUS handler), raises SIGBUS
   and prints "handled N", then starts a thread and waits for it.  `fork code wait`: says
   "ready" and waits for a line first (an attach target).
   `fork starts ROUNDS`: ROUNDS times, starts a thread and forks at once (the thread waits on
   a pipe; the child exits 0 at once), then lets the thread end and waits for both; prints
   "ROUNDS rounds, OK children ok". */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(int i) { sink += i; }

static int pipe_fds[2];

static void *waiter(void *arg) {
  char c;
  return read(pipe_fds[0], &c, 1) == 1 ? arg : NULL;
}

/* How many; the first one's line of /proc/self/maps into `first` (for a failure to say). */
static int rings_of_others(char *first, size_t size) {
  char line[4096], own[32];
  snprintf(own, sizeof own, "/T%d.bts", getpid());
  FILE *maps = fopen("/proc/self/maps", "r");
  int n = 0;
  while (maps != NULL && fgets(line, sizeof line, maps))
    if (strstr(line, ".bts") && !strstr(line, own) && n++ == 0)
      snprintf(first, size, "%s", line);
  if (maps != NULL)
    fclose(maps);
  return n;
}

static int changed_code_pages(void) {
  char line[4096], perms[8], path[4096];
  unsigned long start, end, offset;
  static char file_page[4096];
  FILE *maps = fopen("/proc/self/maps", "r");
  int n = 0;
  while (maps != NULL && fgets(line, sizeof line, maps)) {
    path[0] = '\0';
    if (sscanf(line, "%lx-%lx %7s %lx %*s %*s %4095s", &start, &end, perms, &offset, path) < 4 ||
        perms[2] != 'x' || path[0] != '/' || strstr(line, "(deleted)"))
      continue;
    FILE *file = fopen(path, "rb");
    for (unsigned long page = start; file != NULL && page < end; page += 4096) {
      memset(file_page, 0, sizeof file_page);
      if (fseek(file, (long)(offset + page - start), SEEK_SET) == 0)
        fread(file_page, 1, sizeof file_page, file);
      n += memcmp((const void *)page, file_page, sizeof file_page) != 0;
    }
    if (file != NULL)
      fclose(file);
  }
  if (maps != NULL)
    fclose(maps);
  return n;
}

static void *call_f(void *arg) {
  f(1);
  return arg;
}

static volatile sig_atomic_t buses;
static void on_bus(int sig) { buses += sig == SIGBUS; }

static int code(void) {
  signal(SIGBUS, on_bus);
  printf("parent: %d changed code pages\n", changed_code_pages());
  fflush(stdout);
  pid_t child = fork();
  if (child == 0) {
    static const int faults[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT, SIGTRAP, SIGSYS};
    int foreign = 0;
    for (unsigned i = 0; i < sizeof faults / sizeof *faults; i++) {
      struct sigaction now;
      foreign += sigaction(faults[i], NULL, &now) != 0 ||
                 (now.sa_handler != SIG_DFL && now.sa_handler != on_bus) ||
                 (faults[i] == SIGBUS && now.sa_handler != on_bus);
    }
    printf("child: %d changed code pages, %d fault handlers not its own\n",
           changed_code_pages(), foreign);
    raise(SIGBUS);
    printf("handled %d\n", (int)buses);
    fflush(stdout);
    pthread_t thread;
    return pthread_create(&thread, NULL, call_f, NULL) != 0 || pthread_join(thread, NULL) != 0;
  }
  int status;
  return waitpid(child, &status, 0) != child || !WIFEXITED(status) ? 2 : WEXITSTATUS(status);
}

static void wait_for(const char *dir) {
  char go[4096], done[4096];
  struct stat st;
  snprintf(go, sizeof go, "%s/go", dir);
  snprintf(done, sizeof done, "%s/done", dir);
  for (int i = 0; i < 6000 && stat(go, &st) != 0; i++)
    usleep(10000);
  for (int i = 0; i < 5; i++) f(i);
  FILE *out = fopen(done, "w");
  if (out != NULL)
    fprintf(out, "%ld\n", sink);
  if (out != NULL)
    fclose(out);
}

static int starts(int rounds) {
  int ok = 0;
  for (int i = 0; i < rounds; i++) {
    pthread_t thread;
    if (pipe(pipe_fds) != 0 || pthread_create(&thread, NULL, waiter, NULL) != 0)
      return 2;
    pid_t child = fork();
    if (child == 0)
      _exit(0);
    int status;
    if (write(pipe_fds[1], "x", 1) != 1 || pthread_join(thread, NULL) != 0 ||
        waitpid(child, &status, 0) != child)
      return 2;
    ok += WIFEXITED(status) && WEXITSTATUS(status) == 0;
    close(pipe_fds[0]);
    close(pipe_fds[1]);
  }
  printf("%d rounds, %d children ok\n", rounds, ok);
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 2 && strcmp(argv[1], "starts") == 0)
    return starts(atoi(argv[2]));
  if (argc > 1 && strcmp(argv[1], "code") == 0) {
    if (argc > 2) {
      printf("ready\n");
      fflush(stdout);
      getchar();
    }
    return code();
  }
  int rings = argc > 1 && strcmp(argv[1], "rings") == 0;
  pthread_t thread;
  if (rings && (pipe(pipe_fds) != 0 || pthread_create(&thread, NULL, waiter, NULL) != 0))
    return 2;
  pid_t child = fork();
  if (child == 0 && rings) {
    static char first[4096];
    int n = rings_of_others(first, sizeof first);
    printf("child %d: %d rings\n%s", getpid(), n, first);
    fflush(stdout);
    if (argc > 2) {
      fclose(stdout);
      fclose(stderr);
      wait_for(argv[2]);
    }
    return 0;
  }
  if (rings) {
    if (write(pipe_fds[1], "x", 1) != 1 || pthread_join(thread, NULL) != 0)
      return 2;
    if (argc > 2)
      return 0;
  }
  int n = child == 0 ? 5 : 3;
  for (int i = 0; i < n; i++) f(i);
  if (child == 0) {
    printf("child %ld\n", sink);
    return 0;
  }
  int status;
  waitpid(child, &status, 0);
  printf("parent %ld child-status %d\n", sink, WEXITSTATUS(status));
  return 0;
}
