/* One small function per kind of instruction the xol engine displaces, in assembly so the
   probed instruction is exactly known: a rip-relative load, a call, a conditional jump
   (short and near), a return, a push, a register move, an indirect call. */
#include <stdio.h>

long counter = 41;

__attribute__((noinline)) long helper(long x) { return x * 3; }

long riprel_fn(long x);   /* first instruction: mov counter(%rip), %rax */
long call_fn(long x);     /* +4: call helper */
long jcc_fn(long x);      /* +4: jl (short) */
long jcc32_fn(long x);    /* +4: jl (near, rel32) */
long ret_fn(long x);      /* +4: ret */
long push_fn(long x);     /* first instruction: push %rbx */
long mov_fn(long x);      /* first instruction: mov %rdi, %rax */
long icall_fn(long x, long (*f)(long)); /* +4: call *%rsi */

asm(".text\n"
    ".globl riprel_fn\n.type riprel_fn,@function\nriprel_fn:\n"
    "  mov counter(%rip), %rax\n  add %rdi, %rax\n  ret\n.size riprel_fn,.-riprel_fn\n"
    ".globl call_fn\n.type call_fn,@function\ncall_fn:\n"
    "  sub $8, %rsp\n  call helper\n  add $8, %rsp\n  ret\n.size call_fn,.-call_fn\n"
    ".globl jcc_fn\n.type jcc_fn,@function\njcc_fn:\n"
    "  cmp $5, %rdi\n  jl 1f\n  lea 100(%rdi), %rax\n  ret\n"
    "1: lea 200(%rdi), %rax\n  ret\n.size jcc_fn,.-jcc_fn\n"
    ".globl jcc32_fn\n.type jcc32_fn,@function\njcc32_fn:\n"
    "  cmp $5, %rdi\n  {disp32} jl 2f\n  lea 300(%rdi), %rax\n  ret\n"
    "2: lea 400(%rdi), %rax\n  ret\n.size jcc32_fn,.-jcc32_fn\n"
    ".globl ret_fn\n.type ret_fn,@function\nret_fn:\n"
    "  lea 1(%rdi), %rax\n  ret\n.size ret_fn,.-ret_fn\n"
    ".globl push_fn\n.type push_fn,@function\npush_fn:\n"
    "  push %rbx\n  mov %rdi, %rbx\n  lea 3(%rbx), %rax\n  pop %rbx\n  ret\n"
    ".size push_fn,.-push_fn\n"
    ".globl mov_fn\n.type mov_fn,@function\nmov_fn:\n"
    "  mov %rdi, %rax\n  add $7, %rax\n  ret\n.size mov_fn,.-mov_fn\n"
    ".globl icall_fn\n.type icall_fn,@function\nicall_fn:\n"
    "  sub $8, %rsp\n  call *%rsi\n  add $8, %rsp\n  ret\n.size icall_fn,.-icall_fn\n");

int main(void) {
  long sum = 0;
  for (long i = 0; i < 10; i++) {
    long r[8] = {riprel_fn(i), call_fn(i), jcc_fn(i), jcc32_fn(i),
                 ret_fn(i),    push_fn(i), mov_fn(i), icall_fn(i, helper)};
    for (int k = 0; k < 8; k++) sum = sum * 31 + r[k];
    printf("%ld %ld %ld %ld %ld %ld %ld %ld\n", r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]);
  }
  printf("sum %ld\n", sum);
  return 0;
}
