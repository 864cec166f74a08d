/* One indirect call site with 40 targets, more than Stalker's widened inline cache holds:
   each of argv[1] rounds calls target fK exactly (K % 40 % 3) + 1 times, in a scrambled
   order (table index k holds f(10 + k)). */
#include <stdio.h>
#include <stdlib.h>

volatile long sink;
#define F(k) __attribute__((noinline)) static void f##k(long i) { sink += i + k; }
#define TEN(d) F(d##0) F(d##1) F(d##2) F(d##3) F(d##4) F(d##5) F(d##6) F(d##7) F(d##8) F(d##9)
TEN(1) TEN(2) TEN(3) TEN(4)
#define R(d) f##d##0, f##d##1, f##d##2, f##d##3, f##d##4, f##d##5, f##d##6, f##d##7, f##d##8, f##d##9
static void (*const table[40])(long) = {R(1), R(2), R(3), R(4)};

int main(int argc, char **argv) {
  long rounds = argc > 1 ? atol(argv[1]) : 1000;
  for (long r = 0; r < rounds; r++)
    for (int rep = 0; rep < 3; rep++)
      for (int j = 0; j < 40; j++) {
        int k = (j * 17 + rep * 7) % 40; /* 17 is prime to 40: every k once per rep */
        if (k % 3 >= rep)
          table[k](r);
      }
  printf("%ld\n", sink);
  return 0;
}
