/* A dense switch: gcc compiles it to a jump table (an indirect jump), 16 times. */
#include <stdio.h>

__attribute__((noinline)) int pick(int x) {
  switch (x) {
    case 0: return 11;
    case 1: return 23;
    case 2: return 37;
    case 3: return 41;
    case 4: return 59;
    case 5: return 61;
    case 6: return 79;
    default: return 97;
  }
}

int main(void) {
  int sum = 0;
  for (int i = 0; i < 16; i++) sum += pick(i % 9);
  printf("%d\n", sum);
  return 0;
}
