#define _GNU_SOURCE /* REG_RAX */
/* Blocks whose registers or flags only look dead.  Each case enters a block (after a jmp)
   whose first instructions would let a careless recorder use a register or the flags that
   the block still reads.  The printed values must be the same traced and native. */
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <ucontext.h>

__attribute__((noinline)) static long cmov_keeps(void) { /* capstone: cmov only writes */
  long r;
  __asm__ volatile("mov $5, %%eax\n mov $7, %%edx\n xor %%ecx, %%ecx\n test %%ecx, %%ecx\n"
                   "jmp 1f\n1: cmovne %%edx, %%eax\n mov %%rax, %0"
                   : "=r"(r) : : "rax", "rcx", "rdx", "cc");
  return r;
}

__attribute__((noinline)) static long bsf_of_zero(void) { /* leaves its destination */
  long r;
  __asm__ volatile("mov $9, %%eax\n xor %%edx, %%edx\n jmp 1f\n1: bsf %%rdx, %%rax\n"
                   "mov %%rax, %0" : "=r"(r) : : "rax", "rdx", "cc");
  return r;
}

__attribute__((noinline)) static long partial_write(void) {
  long r;
  __asm__ volatile("mov $0x12345678, %%eax\n jmp 1f\n1: mov $1, %%al\n mov %%rax, %0"
                   : "=r"(r) : : "rax");
  return r;
}

__attribute__((noinline)) static long carry_read(void) { /* rdi dead, the carry is not */
  long r;
  __asm__ volatile("stc\n jmp 1f\n1: mov $3, %%edi\n adc $0, %%edi\n mov %%rdi, %0"
                   : "=r"(r) : : "rdi", "cc");
  return r;
}

__attribute__((noinline)) static long inc_keeps_carry(void) { /* inc writes all but CF */
  long r;
  __asm__ volatile("stc\n jmp 1f\n1: mov $0, %%esi\n inc %%esi\n adc $0, %%esi\n"
                   "mov %%rsi, %0" : "=r"(r) : : "rsi", "cc");
  return r;
}

__attribute__((noinline)) static long zero_flag_read(void) { /* sete reads ZF */
  long r;
  __asm__ volatile("xor %%edx, %%edx\n jmp 1f\n1: mov $0, %%eax\n sete %%al\n"
                   "mov %%rax, %0" : "=r"(r) : : "rax", "rdx", "cc");
  return r;
}

__attribute__((noinline)) static long one_path_overwrites(void) { /* the taken one reads */
  long r;
  __asm__ volatile("mov $11, %%edi\n xor %%eax, %%eax\n jmp 1f\n1: cmp $1, %%eax\n jl 2f\n"
                   "mov $0, %%edi\n2: mov %%rdi, %0" : "=r"(r) : : "rax", "rdi", "cc");
  return r;
}

/* Blocks with no dead register at all: the recorder saves what it uses and restores it. */
__attribute__((noinline)) static long nothing_dead(void) { /* rax, rcx and the carry read */
  long r;
  __asm__ volatile("mov $0x1111, %%eax\n mov $0x2222, %%ecx\n stc\n jmp 1f\n"
                   "1: adc %%rcx, %%rax\n jmp 2f\n2: add %%rcx, %%rax\n mov %%rax, %0"
                   : "=r"(r) : : "rax", "rcx", "cc");
  return r;
}

__attribute__((noinline)) static long only_flags_dead(void) { /* rax and rcx read */
  long r;
  __asm__ volatile("mov $0x1111, %%eax\n mov $0x2222, %%ecx\n jmp 1f\n"
                   "1: add %%rcx, %%rax\n jmp 2f\n2: sub %%rcx, %%rax\n shl $4, %%rcx\n"
                   "add %%rcx, %%rax\n mov %%rax, %0" : "=r"(r) : : "rax", "rcx", "cc");
  return r;
}

static sigjmp_buf recover;
static volatile long rax_at_fault;

static void on_segv(int sig, siginfo_t *info, void *uc) {
  rax_at_fault = ((ucontext_t *)uc)->uc_mcontext.gregs[REG_RAX];
  siglongjmp(recover, 1);
}

__attribute__((noinline)) static void faulting_load(void) { /* rax is read by the handler */
  __asm__ volatile("mov $0x5eed, %%eax\n xor %%ebx, %%ebx\n jmp 1f\n1: mov (%%rbx), %%rax\n"
                   "add $1, %%rax\n"
                   : : : "rax", "rbx", "memory");
}

int main(void) {
  struct sigaction sa = {0};
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigaction(SIGSEGV, &sa, NULL);
  printf("cmov %ld\n", cmov_keeps());
  printf("bsf %ld\n", bsf_of_zero());
  printf("partial %#lx\n", partial_write());
  printf("carry %ld\n", carry_read());
  printf("inc %ld\n", inc_keeps_carry());
  printf("sete %ld\n", zero_flag_read());
  printf("one path %ld\n", one_path_overwrites());
  printf("nothing dead %#lx\n", nothing_dead());
  printf("only flags dead %#lx\n", only_flags_dead());
  if (sigsetjmp(recover, 1) == 0)
    faulting_load();
  printf("rax at fault %#lx\n", rax_at_fault);
  return 0;
}
