/* `vecfork FORKS PAUSE_US [TIMER_US]`: the main thread keeps known values in xmm3 and xmm5
   (and, on a CPU with AVX, all 256 bits of ymm4) through rounds of 20 taken jumps with no
   call between, checking them after each round, while a second thread forks FORKS
   children, PAUSE_US microseconds apart (each child _exit(0)s at once); says "ready"
   first, and then "ROUNDS rounds, M saw them changed, C children exited 0" (Frida's
   injector runs code on the main thread after each fork() under child gating).  With
   TIMER_US, SIGALRM comes every TIMER_US microseconds meanwhile, to the main thread (the
   forker blocks it), and its handler only counts. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

static const unsigned int known[8] __attribute__((aligned(32))) = {
    0x11111111, 0x22222222, 0x33333333, 0x44444444,
    0x55555555, 0x66666666, 0x77777777, 0x88888888};
static volatile int forks_done;
static int forks, pause_us, children_ok;

static volatile long ticks;
static void on_alarm(int sig) {
  (void)sig;
  ticks++;
}

static void *forker(void *unused) {
  (void)unused;
  sigset_t alarm;
  sigemptyset(&alarm);
  sigaddset(&alarm, SIGALRM);
  pthread_sigmask(SIG_BLOCK, &alarm, NULL);
  for (int i = 0; i < forks; i++) {
    pid_t child = fork();
    if (child == 0)
      _exit(0);
    int status;
    children_ok += waitpid(child, &status, 0) == child && WIFEXITED(status) &&
                   WEXITSTATUS(status) == 0;
    usleep(pause_us);
  }
  forks_done = 1;
  return NULL;
}

/* The asm shared by the two: 20 taken jumps, then edx = 0xffff if xmm3 and xmm5 hold
   `known`, else less. */
#define TWENTY_JUMPS ".rept 20\n test %%rsp, %%rsp\n jnz 2f\n nop\n2:\n .endr\n"
#define CHECK_XMM                                                                           \
  "movdqa %%xmm3, %%xmm0\n pcmpeqd (%[known]), %%xmm0\n pmovmskb %%xmm0, %%edx\n"            \
  "movdqa %%xmm5, %%xmm0\n pcmpeqd (%[known]), %%xmm0\n pmovmskb %%xmm0, %%ecx\n"            \
  "and %%ecx, %%edx\n"
#define LOAD_XMM "movdqa (%[known]), %%xmm3\n movdqa (%[known]), %%xmm5\n"
#define OPERANDS                                                                            \
  : [changed] "+r"(changed), [n] "+r"(n)                                                    \
  : [known] "r"(known), [done] "r"(&forks_done)

/* xmm3 and xmm5 against `known`, until forks_done; returns the rounds that saw a change */
static long rounds_sse(long *rounds) {
  long changed = 0, n = 0;
  __asm__ volatile(LOAD_XMM "1:\n" TWENTY_JUMPS "inc %[n]\n" CHECK_XMM
                   "cmp $0xffff, %%edx\n je 3f\n inc %[changed]\n" LOAD_XMM
                   "3:\n cmpl $0, (%[done])\n je 1b\n" OPERANDS
                   : "rcx", "rdx", "xmm0", "xmm3", "xmm5", "memory", "cc");
  *rounds = n;
  return changed;
}

/* the same with all 256 bits of ymm4 as well */
__attribute__((target("avx"))) static long rounds_avx(long *rounds) {
  long changed = 0, n = 0;
  __asm__ volatile(LOAD_XMM "vmovdqa (%[known]), %%ymm4\n 1:\n" TWENTY_JUMPS "inc %[n]\n"
                   CHECK_XMM
                   "vpcmpeqd (%[known]), %%xmm4, %%xmm0\n vpmovmskb %%xmm0, %%ecx\n"
                   "and %%ecx, %%edx\n"
                   "vextractf128 $1, %%ymm4, %%xmm0\n vpcmpeqd 16(%[known]), %%xmm0, %%xmm0\n"
                   "vpmovmskb %%xmm0, %%ecx\n and %%ecx, %%edx\n"
                   "cmp $0xffff, %%edx\n je 3f\n inc %[changed]\n" LOAD_XMM
                   "vmovdqa (%[known]), %%ymm4\n"
                   "3:\n cmpl $0, (%[done])\n je 1b\n" OPERANDS
                   : "rcx", "rdx", "xmm0", "xmm3", "xmm4", "xmm5", "memory", "cc");
  *rounds = n;
  return changed;
}

int main(int argc, char **argv) {
  if (argc != 3 && argc != 4) {
    fprintf(stderr, "usage: vecfork FORKS PAUSE_US [TIMER_US]\n");
    return 2;
  }
  forks = atoi(argv[1]);
  pause_us = atoi(argv[2]);
  if (argc == 4) {
    struct sigaction action = {.sa_handler = on_alarm, .sa_flags = SA_RESTART};
    sigaction(SIGALRM, &action, NULL);
    struct itimerval every = {{0, atol(argv[3])}, {0, atol(argv[3])}};
    setitimer(ITIMER_REAL, &every, NULL);
  }
  printf("ready %d\n", getpid());
  fflush(stdout);
  __builtin_cpu_init();
  pthread_t thread;
  if (pthread_create(&thread, NULL, forker, NULL) != 0)
    return 2;
  long rounds, changed = __builtin_cpu_supports("avx") ? rounds_avx(&rounds) : rounds_sse(&rounds);
  pthread_join(thread, NULL);
  printf("%ld rounds, %ld saw them changed, %d children exited 0\n", rounds, changed,
         children_ok);
  return 0;
}
