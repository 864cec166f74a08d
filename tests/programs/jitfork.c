/* One thread runs code it has just written, a new function each time, without pause (as a
   JIT does), so that under Stalker it is compiling code in no module nearly all the time
   (the recorder's agent asks its script about each such block: docs/fork.md section 21);
   meanwhile main forks ROUNDS times (argv[1], default 30), 2 ms apart, each child calling
   f() 3 times and exiting 0, and then stops the JIT thread.  Prints "N of ROUNDS children
   ok, M functions run".
   With ROOM (argv[2], MiB): the process first limits its address space (RLIMIT_AS) to what
   it has mapped plus ROOM and 16 MiB (the JIT thread's stack), and the JIT thread runs all
   4,194,304 of its functions.  Natively that needs none of the room; under Stalker, which
   compiles each new function for the thread and keeps it until the thread takes a fresh
   context (after a million blocks), the room runs out first and Frida's code fails inside
   the thread (README, "Stalker's limit": the failure that some two million blocks brought
   in one context without a limit).  With FUNCTIONS (argv[3]) as well, the JIT thread runs
   that many functions instead of all of them. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CODE_SIZE (64 << 20)
#define FUNCTION_SIZE 16

volatile long sink;
__attribute__((noinline)) void f(long i) { sink += i; }
static int done;
static long functions_run;
static long functions_max = CODE_SIZE / FUNCTION_SIZE;

static void *jit(void *arg) {
  unsigned char *code = arg;
  for (long at = 0; at < functions_max * FUNCTION_SIZE && !__atomic_load_n(&done, __ATOMIC_SEQ_CST);
       at += FUNCTION_SIZE) {
    unsigned char *fn = code + at;
    int value = (int)(at / FUNCTION_SIZE);
    fn[0] = 0xb8; /* mov eax, value */
    memcpy(fn + 1, &value, 4);
    fn[5] = 0xc3; /* ret */
    if (((int (*)(void))fn)() != value)
      abort();
    functions_run++;
  }
  return NULL;
}

static long mapped_bytes(void) {
  FILE *maps = fopen("/proc/self/maps", "r");
  char line[512];
  long total = 0;
  unsigned long lo, hi;
  if (maps == NULL)
    exit(5);
  while (fgets(line, sizeof line, maps))
    if (sscanf(line, "%lx-%lx", &lo, &hi) == 2)
      total += (long)(hi - lo);
  fclose(maps);
  return total;
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 30, ok = 0;
  unsigned char *code = mmap(NULL, CODE_SIZE, PROT_READ | PROT_WRITE | PROT_EXEC,
                             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (code == MAP_FAILED)
    return 2;
  if (argc > 3 && atol(argv[3]) < functions_max)
    functions_max = atol(argv[3]);
  if (argc > 2) {
    rlim_t room = (rlim_t)atol(argv[2]) << 20;
    struct rlimit limit = {(rlim_t)mapped_bytes() + room + (16 << 20), 0};
    limit.rlim_max = limit.rlim_cur;
    if (setrlimit(RLIMIT_AS, &limit) != 0)
      return 3;
  }
  pthread_t t;
  pthread_create(&t, NULL, jit, code);
  for (int r = 0; r < rounds; r++) {
    struct timespec pause = {0, 2000000};
    nanosleep(&pause, NULL);
    pid_t child = fork();
    if (child == 0) {
      for (long i = 0; i < 3; i++)
        f(i);
      _exit(0);
    }
    int status = -1;
    if (child > 0 && waitpid(child, &status, 0) == child && status == 0)
      ok++;
    else
      fprintf(stderr, "round %d: child %d status %#x\n", r, child, status);
  }
  if (argc <= 2)
    __atomic_store_n(&done, 1, __ATOMIC_SEQ_CST);
  pthread_join(t, NULL);
  printf("%d of %d children ok, %ld functions run\n", ok, rounds, functions_run);
  return ok == rounds ? 0 : 1;
}
