/* Forks ROUNDS children (200) one after the other, each exiting at once, and prints its
   own virtual size in KiB (VmSize) after the first FIRST (20) and after the last:
   "vm FIRST KIB", "vm ROUNDS KIB".  What a recorder keeps per fork shows as the difference. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static long vm_kib(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long kib = -1;
  while (f != NULL && fgets(line, sizeof line, f) != NULL)
    if (strncmp(line, "VmSize:", 7) == 0)
      kib = atol(line + 7);
  if (f != NULL)
    fclose(f);
  return kib;
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 200;
  int first = argc > 2 ? atoi(argv[2]) : 20;
  for (int round = 1; round <= rounds; round++) {
    pid_t child = fork();
    if (child == 0)
      _exit(0);
    waitpid(child, NULL, 0);
    if (round == first || round == rounds)
      printf("vm %d %ld\n", round, vm_kib());
  }
  return 0;
}
