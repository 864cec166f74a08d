/* One thread runs code it has just written, a new 6-byte function each time (as a JIT
   does), 4,194,304 of them, with the process's address space limited (RLIMIT_AS) to what
   it has mapped plus ROOM MiB (argv[1], default 256) and 16 MiB: natively it needs none of
   that room; under Stalker, which compiles each new function for the thread and keeps
   it, the room runs out and Frida's code fails inside the thread (README, "A limit of
   Stalker's", the same failure that about two million blocks bring without a limit).
   Prints "N functions run". */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>

#define CODE_SIZE (64 << 20)
#define FUNCTION_SIZE 16

static long functions_run;

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

static void *jit(void *arg) {
  unsigned char *code = arg;
  for (long at = 0; at + FUNCTION_SIZE <= CODE_SIZE; at += FUNCTION_SIZE) {
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

int main(int argc, char **argv) {
  long room = (argc > 1 ? atol(argv[1]) : 256) << 20;
  unsigned char *code = mmap(NULL, CODE_SIZE, PROT_READ | PROT_WRITE | PROT_EXEC,
                             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (code == MAP_FAILED)
    return 2;
  /* the new thread's stack (8 MiB) comes out of the 16 MiB */
  struct rlimit limit = {(rlim_t)(mapped_bytes() + room + (16 << 20)), 0};
  limit.rlim_max = limit.rlim_cur;
  if (setrlimit(RLIMIT_AS, &limit) != 0)
    return 3;
  pthread_t t;
  if (pthread_create(&t, NULL, jit, code) != 0)
    return 4;
  pthread_join(t, NULL);
  printf("%ld functions run\n", functions_run);
  return 0;
}
