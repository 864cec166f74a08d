/* A child stuck the way one forked while Frida's agent loads is (engines/forkwindow.py): in
   a dlmalloc-style spin lock (the instruction sequence of frida-agent's, written out below),
   run from a memfd named like Frida's agent, on a lock no thread of the child holds.
   Says "ready", forks when a line comes on stdin, says "child PID" and waits for it: the
   child takes the lock and exits 0 once someone else clears it.  With argv[1] "plain" the
   child spins in an ordinary C loop instead, and with "threads" it has a second thread:
   neither may be touched.  With "gum" the child spins in Gum's spin lock, which never
   yields, instead of dlmalloc's.  With "twice" the child, once freed, takes the lock again while
   it holds it: releasing that would break its own critical section.  Prints the child's wait status when it ends. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

static const unsigned char spin_acquire_lock[] = {
    0x41, 0x54,                         /* push r12 */
    0x41, 0xbc, 0x01, 0, 0, 0,          /* mov r12d, 1 */
    0x55,                               /* push rbp */
    0x31, 0xed,                         /* xor ebp, ebp */
    0x53,                               /* push rbx */
    0x48, 0x89, 0xfb,                   /* mov rbx, rdi */
    0x8b, 0x03,                         /* head: mov eax, [rbx] */
    0x85, 0xc0,                         /* test eax, eax */
    0x74, 0x0f,                         /* je take */
    0xff, 0xc5,                         /* spin: inc ebp */
    0x40, 0xf6, 0xc5, 0x3f,             /* test bpl, 63 */
    0x75, 0xf2,                         /* jne head */
    0xe8, 0x10, 0, 0, 0,                /* call yield */
    0xeb, 0xeb,                         /* jmp head */
    0x44, 0x89, 0xe0,                   /* take: mov eax, r12d */
    0x87, 0x03,                         /* xchg [rbx], eax */
    0x85, 0xc0,                         /* test eax, eax */
    0x75, 0xe8,                         /* jne spin */
    0x5b, 0x5d, 0x41, 0x5c, 0xc3,       /* pop rbx; pop rbp; pop r12; ret */
    0xb8, 0x18, 0, 0, 0,                /* yield: mov eax, SYS_sched_yield */
    0x0f, 0x05, 0xc3,                   /* syscall; ret */
};

/* Gum's spin lock, which never yields (gum_spinlock_acquire) */
static const unsigned char gum_spinlock_acquire[] = {
    0x31, 0xd2,                         /* xor edx, edx */
    0xb9, 0x01, 0, 0, 0,                /* mov ecx, 1 */
    0x89, 0xd0,                         /* loop: mov eax, edx */
    0xf0, 0x0f, 0xb1, 0x0f,             /* lock cmpxchg [rdi], ecx */
    0x75, 0xf8,                         /* jne loop */
    0xc3,                               /* ret */
};

static volatile int lock = 1; /* "held" by a thread the child does not have */

static void *idle(void *arg) {
  pause();
  return arg;
}

int main(int argc, char **argv) {
  const char *how = argc > 1 ? argv[1] : "frida";
  int fd = memfd_create("frida-agent-64.so", 0);
  if (fd < 0 || write(fd, spin_acquire_lock, sizeof spin_acquire_lock) < 0 ||
      write(fd, gum_spinlock_acquire, sizeof gum_spinlock_acquire) < 0)
    return perror("memfd"), 2;
  unsigned char *code = mmap(NULL, sizeof spin_acquire_lock + sizeof gum_spinlock_acquire,
                             PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
  if (code == MAP_FAILED)
    return perror("mmap"), 2;
  void (*acquire)(volatile int *) = (void (*)(volatile int *))(
      strcmp(how, "gum") == 0 ? code + sizeof spin_acquire_lock : code);
  char line[8];
  printf("ready\n");
  fflush(stdout);
  if (!fgets(line, sizeof line, stdin))
    return 2;
  pid_t child = fork();
  if (child == 0) {
    if (strcmp(how, "plain") == 0)
      while (lock) {
      }
    if (strcmp(how, "threads") == 0) {
      pthread_t thread;
      pthread_create(&thread, NULL, idle, NULL);
    }
    acquire(&lock);
    if (strcmp(how, "twice") == 0)
      acquire(&lock);
    _exit(0);
  }
  printf("child %d\n", child);
  fflush(stdout);
  int status;
  waitpid(child, &status, 0);
  printf("status %d\n", status);
  return 0;
}
