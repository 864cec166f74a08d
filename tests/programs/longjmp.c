/* setjmp/longjmp: three times, down() recurses 5 deep and longjmps back to main. */
#include <setjmp.h>
#include <stdio.h>

static jmp_buf env;
volatile long sink;

__attribute__((noinline)) void down(int depth) {
  sink += depth;
  if (depth == 5) longjmp(env, depth);
  down(depth + 1);
}

int main(void) {
  for (int round = 0; round < 3; round++) {
    if (setjmp(env) == 0) down(1);
  }
  printf("%ld\n", sink);
  return 0;
}
