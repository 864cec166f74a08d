/* Exactly 23 calls of f (a prime number of events, as bcc's guidelines ask). */
#include <stdio.h>

volatile int sink;
__attribute__((noinline)) void f(int i) { sink += i; }

int main(void) {
  for (int i = 0; i < 23; i++) f(i);
  printf("%d\n", sink);
  return 0;
}
