/* A child stuck the way a shell's subshell forked while Frida's agent loads is
   (engines/forkwindow.py): asleep in pthread_mutex_lock(), called from code run from a memfd
   named like Frida's agent, on a recursive mutex (a GRecMutex, as Frida's thread registry
   has) that a thread the child does not have held at the fork.
   Says "ready", forks when a line comes on stdin, says "child PID" and waits for it: the
   child takes the mutex, then exits with what unlocking it returns (0: it owned it).  With
   argv[1] "plain" the child calls pthread_mutex_lock() from the program's own code, a
   deadlock of the program's, and with "threads" it has a second thread: neither may be
   touched.  Prints the child's wait status when it ends. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

/* int agent_call(pthread_mutex_t *mutex, int (*lock)(pthread_mutex_t *)) */
static const unsigned char agent_call_code[] = {
    0x53,       /* push rbx: the stack aligned for the call */
    0xff, 0xd6, /* call rsi */
    0x5b,       /* pop rbx */
    0xc3,       /* ret */
};

static pthread_mutex_t mutex;
static pthread_mutex_t taken = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t taken_cond = PTHREAD_COND_INITIALIZER;
static int holder_ready;

static void *holder(void *arg) {
  pthread_mutex_lock(&mutex);
  pthread_mutex_lock(&taken);
  holder_ready = 1;
  pthread_cond_signal(&taken_cond);
  pthread_mutex_unlock(&taken);
  pause();
  return arg;
}

static void *idle(void *arg) {
  pause();
  return arg;
}

int main(int argc, char **argv) {
  const char *how = argc > 1 ? argv[1] : "frida";
  int fd = memfd_create("frida-agent-64.so", 0);
  if (fd < 0 || write(fd, agent_call_code, sizeof agent_call_code) < 0)
    return perror("memfd"), 2;
  int (*agent_call)(pthread_mutex_t *, int (*)(pthread_mutex_t *)) =
      (int (*)(pthread_mutex_t *, int (*)(pthread_mutex_t *)))mmap(
          NULL, sizeof agent_call_code, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
  if (agent_call == MAP_FAILED)
    return perror("mmap"), 2;
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&mutex, &attr);
  pthread_t thread;
  pthread_create(&thread, NULL, holder, NULL);
  pthread_mutex_lock(&taken);
  while (!holder_ready)
    pthread_cond_wait(&taken_cond, &taken);
  pthread_mutex_unlock(&taken);
  char line[8];
  printf("ready\n");
  fflush(stdout);
  if (!fgets(line, sizeof line, stdin))
    return 2;
  pid_t child = fork();
  if (child == 0) {
    if (strcmp(how, "threads") == 0) {
      pthread_t second;
      pthread_create(&second, NULL, idle, NULL);
    }
    if (strcmp(how, "plain") == 0)
      pthread_mutex_lock(&mutex);
    else
      agent_call(&mutex, pthread_mutex_lock);
    _exit(pthread_mutex_unlock(&mutex));
  }
  printf("child %d\n", child);
  fflush(stdout);
  int status;
  waitpid(child, &status, 0);
  printf("status %d\n", status);
  return 0;
}
