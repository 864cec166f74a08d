/* Code that keeps values where a thread sent off from any of its blocks could lose them:
   in vector registers (libc's string routines, AVX2 on most machines: strchrnul() in
   printf's format scan, strlen(), memcpy(); double arithmetic) and under the stack
   pointer (a leaf function's locals, in the red zone at -O0), ROUNDS times (argv[1],
   default 2000).  Prints a checksum of all it formatted and computed, which any of those
   changed under it changes (into the file argv[2] names, if any). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

__attribute__((noinline)) double step(double x, int i) { return x * 1.0000001 + i / 3.0; }

__attribute__((noinline)) unsigned long mix(unsigned long n) {
  unsigned long s = 0;
  for (unsigned long i = 0; i < n; i++)
    s += i ^ (s >> 3);
  return s;
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 2000;
  unsigned long sum = 0;
  double x = 1.0;
  char line[128], copy[128];
  for (int i = 0; i < rounds; i++) {
    x = step(x, i);
    int n = snprintf(line, sizeof line, "%d %s %.3f|", i, i % 3 ? "abc" : "de", x);
    memcpy(copy, line, (size_t)n + 1);
    sum = sum * 31 + strlen(copy) + (unsigned long)(strchr(copy, '|') - copy) + mix(40);
    for (int k = 0; k < n; k++)
      sum += (unsigned char)copy[k];
  }
  FILE *out = argc > 2 ? fopen(argv[2], "w") : stdout;
  if (out == NULL)
    return 2;
  fprintf(out, "%lu %.6f\n", sum, x);
  return fclose(out) != 0;
}
