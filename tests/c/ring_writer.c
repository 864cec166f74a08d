/* A C writer process for the store tests: writes COUNT numbered records into a ring. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static void bt_futex_wait(uint32_t *addr, uint32_t expected, long timeout_ns) {
  struct timespec ts = {timeout_ns / 1000000000L, timeout_ns % 1000000000L};
  syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, NULL, 0);
}
static void bt_futex_wake(uint32_t *addr) { syscall(SYS_futex, addr, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0); }
static void bt_notify(uint32_t pid, uint32_t sig) { kill((pid_t)pid, (int)sig); }
struct bt_writer;
static int bt_consumer_alive(struct bt_writer *w);

#include "bt_writer_full.h"

static int bt_consumer_alive(struct bt_writer *w) {
  struct flock lk = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 1, .l_len = 1};
  return fcntl(w->fd, F_OFD_GETLK, &lk) == 0 && lk.l_type != F_UNLCK;
}

/* Record i is BLOCK(start=i, last_off=i & 0xffff), or every -e N a BRANCH(CALL, i, i), or
   every -p N a PROBE_HIT(probe 7) of 62 payload words all equal to i. */
int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: ring_writer PATH COUNT [-l] [-e N] [-p N] [-r]\n");
    return 2;
  }
  uint64_t count = strtoull(argv[2], NULL, 0), esc = 0, probe = 0;
  int lazy = 0, ready = 0;
  for (int i = 3; i < argc; i++) {
    if (!strcmp(argv[i], "-l")) lazy = 1;
    else if (!strcmp(argv[i], "-r")) ready = 1;
    else if (!strcmp(argv[i], "-e") && i + 1 < argc) esc = strtoull(argv[++i], NULL, 0);
    else if (!strcmp(argv[i], "-p") && i + 1 < argc) probe = strtoull(argv[++i], NULL, 0);
  }
  int fd = open(argv[1], O_RDWR);
  if (fd < 0) { perror("open"); return 2; }
  struct flock lk = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
  if (fcntl(fd, F_OFD_SETLK, &lk) < 0) { fprintf(stderr, "busy\n"); return 3; }
  struct stat st;
  fstat(fd, &st);
  void *map = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) { perror("mmap"); return 2; }
  struct bt_writer w;
  if (bt_writer_init(&w, map, fd, !lazy, (uint32_t)getpid())) { fprintf(stderr, "not a ring\n"); return 2; }
  uint64_t lost = 0, rec[BT_MAX_RING_PAYLOAD + 1];
  for (uint64_t i = 1; count == 0 || i <= count; i++) {
    int r;
    if (esc && i % esc == 0) {
      r = bt_branch(&w, BT_KIND_CALL, i, i);
    } else if (probe && i % probe == 0) {
      rec[0] = bt_escape(BT_RECORDTYPE_PROBE_HIT, BT_MAX_RING_PAYLOAD, 7);
      for (int k = 1; k <= BT_MAX_RING_PAYLOAD; k++) rec[k] = i;
      r = bt_write(&w, rec, BT_MAX_RING_PAYLOAD + 1);
    } else {
      r = bt_block(&w, i, i & 0xffff);
    }
    lost += r != 0;
    if (ready && i == 1000) { bt_writer_flush(&w); printf("ready\n"); fflush(stdout); }
  }
  bt_writer_close(&w);
  printf("written %llu lost %llu\n", (unsigned long long)(count - lost), (unsigned long long)lost);
  return 0;
}
