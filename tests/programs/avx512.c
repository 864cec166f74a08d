/* `avx512 regs ROUNDS CHILDREN`: keeps known values in zmm5, zmm15, zmm16 (all 512 bits
   each) and the mask register k1 through ROUNDS rounds of 20 taken jumps (each a block of
   its own for a tracer) with no call between, checks them after each round, and prints
   "parent: N of ROUNDS rounds saw them changed"; then CHILDREN times forks a child that does
   the same (exit status 1 if any round saw a change) and prints "children: M saw them
   changed".  Prints "no AVX-512" and does nothing else on a CPU without AVX-512F and BW.
   `avx512 threads N`: starts N threads one after the other; thread i searches with its
   first strstr() a haystack whose match begins at byte i; prints "N threads, M found a
   wrong place" (glibc's AVX-512 strstr() keeps the needle's first byte in all 512 bits of
   a register across its loop). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* (the target attribute lets the asm name AVX-512's registers; only called where the CPU
   has them) */
__attribute__((target("avx512f,avx512bw"))) static long rounds_changed(long rounds) {
  static const unsigned long known[8] = {
      0x1111111111111111, 0x2222222222222222, 0x3333333333333333, 0x4444444444444444,
      0x5555555555555555, 0x6666666666666666, 0x7777777777777777, 0x8888888888888888};
  long changed = 0;
  __asm__ volatile(
      "vmovdqu64 (%[known]), %%zmm30\n"
      "vmovdqu64 %%zmm30, %%zmm5\n"
      "vmovdqu64 %%zmm30, %%zmm15\n"
      "vmovdqu64 %%zmm30, %%zmm16\n"
      "mov $0x5a5a5a5a5a5a5a5a, %%rax\n"
      "kmovq %%rax, %%k1\n"
      "1:\n"
      ".rept 20\n"
      "test %%rax, %%rax\n"
      "jnz 2f\n"
      "nop\n"
      "2:\n"
      ".endr\n"
      /* every 64-bit lane of each register as it was: 0xff from each comparison */
      "vpcmpeqq %%zmm5, %%zmm30, %%k2\n"
      "kmovw %%k2, %%edx\n"
      "vpcmpeqq %%zmm15, %%zmm30, %%k2\n"
      "kmovw %%k2, %%ecx\n"
      "and %%ecx, %%edx\n"
      "vpcmpeqq %%zmm16, %%zmm30, %%k2\n"
      "kmovw %%k2, %%ecx\n"
      "and %%ecx, %%edx\n"
      "kmovq %%k1, %%rcx\n"
      "cmp %%rax, %%rcx\n"
      "jne 3f\n"
      "cmp $0xff, %%edx\n"
      "je 4f\n"
      "3:\n"
      "inc %[changed]\n"
      "vmovdqu64 %%zmm30, %%zmm5\n"
      "vmovdqu64 %%zmm30, %%zmm15\n"
      "vmovdqu64 %%zmm30, %%zmm16\n"
      "kmovq %%rax, %%k1\n"
      "4:\n"
      "dec %[rounds]\n"
      "jnz 1b\n"
      : [changed] "+r"(changed), [rounds] "+r"(rounds)
      : [known] "r"(known)
      : "rax", "rcx", "rdx", "xmm5", "xmm15", "xmm16", "xmm30", "k1", "k2", "memory", "cc");
  return changed;
}

static int regs(long rounds, int children) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) {
    printf("no AVX-512\n");
    return 0;
  }
  printf("parent: %ld of %ld rounds saw them changed\n", rounds_changed(rounds), rounds);
  fflush(stdout);
  int changed = 0;
  for (int i = 0; i < children; i++) {
    pid_t child = fork();
    if (child == 0)
      _exit(rounds_changed(rounds) != 0);
    int status;
    changed += waitpid(child, &status, 0) != child || !WIFEXITED(status) ||
               WEXITSTATUS(status) != 0;
  }
  printf("children: %d saw them changed\n", changed);
  return 0;
}

static int search_at(int at) {
  char haystack[200]; /* 150 bytes: the match at 0 .. 140 */
  memset(haystack, 'a', sizeof haystack);
  memcpy(haystack + at, "/T123.bts", 9);
  haystack[150] = '\0';
  return strstr(haystack, "/T123.bts") != haystack + at;
}

static void *search_in_thread(void *at) {
  return (void *)(long)search_at((int)(long)at);
}

static int searches(int n) {
  int wrong = 0;
  for (int at = 0; at < n; at++) {
    pthread_t thread;
    void *result = (void *)1L;
    if (pthread_create(&thread, NULL, search_in_thread, (void *)(long)at) != 0 ||
        pthread_join(thread, &result) != 0)
      return 2;
    wrong += result != NULL;
  }
  printf("%d threads, %d found a wrong place\n", n, wrong);
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 4 && strcmp(argv[1], "regs") == 0)
    return regs(atol(argv[2]), atoi(argv[3]));
  if (argc == 3 && strcmp(argv[1], "threads") == 0)
    return searches(atoi(argv[2]));
  fprintf(stderr, "usage: avx512 regs ROUNDS CHILDREN | avx512 threads N\n");
  return 2;
}
