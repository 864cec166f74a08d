/* Loads libm at run time and calls cos through the pointer dlsym gives. */
#include <dlfcn.h>
#include <stdio.h>

int main(void) {
  void *h = dlopen("libm.so.6", RTLD_NOW);
  if (!h) return 1;
  double (*cosine)(double) = (double (*)(double))dlsym(h, "cos");
  printf("%.3f\n", cosine(0.0));
  dlclose(h);
  return 0;
}
