/* qsort with a comparator: libc calling back into the program. */
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) static int cmp(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}
int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 1000000;
  int *v = malloc(sizeof(int) * n);
  unsigned s = 12345;
  for (int i = 0; i < n; i++) v[i] = (int)(s = s * 1103515245u + 12345u);
  qsort(v, n, sizeof(int), cmp);
  printf("%d %d\n", v[0], v[n - 1]);
  return 0;
}
