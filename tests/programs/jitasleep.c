/* An attach target asleep with the address of anonymous executable memory (as a JIT's
   code) on its stack: says "ready", waits for a line on stdin, then says "ok" and exits 0. */
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

int main(void) {
  void *volatile code = mmap(NULL, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS,
                             -1, 0);
  if (code == MAP_FAILED)
    return 2;
  printf("ready %d\n", getpid());
  fflush(stdout);
  char line[16];
  if (read(0, line, sizeof line) < 0)
    return 1;
  puts(code != NULL ? "ok" : "bad");
  return 0;
}
