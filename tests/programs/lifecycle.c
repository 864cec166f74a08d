/* Code that runs outside main: a constructor allocates the table and calls step() once;
   after main returns, an atexit handler calls step() 3 times and prints the sum (6)
   through stdio, flushed by exit(); then a destructor calls step() twice.
   `lifecycle exit-crash`: the handler's third step() faults: SIGSEGV inside exit().
   `lifecycle init-crash`: the constructor's step() faults: SIGSEGV before main. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int *table;
static int faulting_step = -1;

__attribute__((noinline)) static int step(int i) {
  return table[i == faulting_step ? 1 << 28 : i];
}

static void handler(void) {
  int sum = 0;
  for (int i = 0; i < 3; i++)
    sum += step(i);
  printf("sum %d\n", sum);
}

/* glibc passes a constructor main's argc and argv */
__attribute__((constructor)) static void setup(int argc, char **argv) {
  table = calloc(4, sizeof *table);
  if (argc > 1 && strcmp(argv[1], "init-crash") == 0)
    faulting_step = 0;
  step(0);
  if (argc > 1 && strcmp(argv[1], "exit-crash") == 0)
    faulting_step = 2;
}

__attribute__((destructor)) static void teardown(void) {
  step(0);
  step(1);
}

int main(void) {
  table[1] = 2;
  table[2] = 4;
  atexit(handler);
  return 0;
}
