/* Forks ROUNDS children (200) one after the other, each exiting at once, and prints its
   own virtual size in KiB (VmSize) after the first FIRST (20) and after the last:
   "vm FIRST KIB", "vm ROUNDS KIB".  What a recorder keeps per fork shows as the difference.
   HOW: "got" (the default) calls fork() as programs do, through the GOT; "pointer" calls
   the address dlsym() gives, as a program that looked fork() up itself; "thread" does
   that from a second thread, main waiting for it. */
#include <dlfcn.h>
#include <pthread.h>
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

static int rounds = 200, first = 20;
static pid_t (*fork_at)(void);

static void *forks(void *unused) {
  (void)unused;
  for (int round = 1; round <= rounds; round++) {
    pid_t child = fork_at != NULL ? fork_at() : fork();
    if (child == 0)
      _exit(0);
    waitpid(child, NULL, 0);
    if (round == first || round == rounds)
      printf("vm %d %ld\n", round, vm_kib());
  }
  return NULL;
}

int main(int argc, char **argv) {
  rounds = argc > 1 ? atoi(argv[1]) : 200;
  first = argc > 2 ? atoi(argv[2]) : 20;
  const char *how = argc > 3 ? argv[3] : "got";
  if (strcmp(how, "pointer") == 0 || strcmp(how, "thread") == 0)
    fork_at = (pid_t(*)(void))dlsym(RTLD_DEFAULT, "fork");
  pthread_t thread;
  if (strcmp(how, "thread") != 0)
    forks(NULL);
  else if (pthread_create(&thread, NULL, forks, NULL) != 0 || pthread_join(thread, NULL) != 0)
    return 1;
  return 0;
}
