/* ROUNDS (argv[1], 3) times: f(), then vfork(); the child, which shares the parent's memory
   until it execs or exits, calls in_child() and f() and execs /bin/true (odd rounds: exits
   with _exit(0) instead); the parent, suspended meanwhile, waits for it and calls f()
   again.  Prints "ROUNDS rounds"; exits 1 if a child did not exit 0.  The parent's trace
   holds f() 2 * ROUNDS times and in_child() never: the children's calls ran in other
   processes. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

volatile long sink;
__attribute__((noinline)) void f(long i) { sink += i; }
__attribute__((noinline)) void in_child(void) { sink++; }

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 3;
  for (int r = 0; r < rounds; r++) {
    f(r);
    pid_t pid = vfork();
    if (pid == 0) {
      in_child();
      f(-1);
      if (r % 2 == 0)
        execl("/bin/true", "true", (char *)NULL);
      _exit(0);
    }
    int status = -1;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || status != 0)
      return 1;
    f(r);
  }
  printf("%d rounds\n", rounds);
  return 0;
}
