/* Calls probed() N times and prints the time per call, measured inside the program (so
   start-up, attaching and the end of probing are not part of it). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

volatile long sink;
__attribute__((noinline)) long probed(long i, long j) {
  sink += i ^ j;
  return sink;
}

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 100000;
  probed(0, 0); /* warm: the first hit of some engines pays set-up */
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (long i = 0; i < n; i++) probed(i, n);
  clock_gettime(CLOCK_MONOTONIC, &b);
  double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
  printf("calls %ld ns_per_call %.1f\n", n, ns / n);
  return 0;
}
