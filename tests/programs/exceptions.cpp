// C++ exceptions: three times, thrower() is reached 3 calls deep and throws; main catches.
#include <cstdio>

volatile long sink;
__attribute__((noinline)) void thrower(int depth) {
  sink += depth;
  if (depth == 3) throw depth;
  thrower(depth + 1);
}

int main() {
  for (int round = 0; round < 3; round++) {
    try {
      thrower(1);
    } catch (int e) {
      sink += e;
    }
  }
  std::printf("%ld\n", sink);
  return 0;
}
