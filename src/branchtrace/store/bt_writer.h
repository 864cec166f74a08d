/*
 * The C writer of a branchtrace ring: the twin of ring.RingWriter, for writers that live
 * inside the traced process.  Header-only; include it after the BT_* definitions that
 * branchtrace.store.format.c_definitions() generates (one definition of the layout).
 *
 * The includer provides the environment, so that the same code builds with gcc and inside
 * a Frida CModule:
 *   bt_futex_wait(uint32_t *addr, uint32_t expected, long timeout_ns)
 *   bt_futex_wake(uint32_t *addr)
 *   bt_notify(uint32_t pid, uint32_t sig)      -- signal a stalled consumer
 *   bt_consumer_alive(struct bt_writer *w)     -- is a consumer holding the ring (OFD lock
 *                                                 on byte 1 of w->fd)?
 *   memset
 * and holds the writer lock (an OFD lock on byte 0 of the file) for as long as it writes.
 *
 * Ordering: x86-64 keeps stores in program order, so a record's words are visible before
 * the data_head that publishes them; the compiler is kept in order with bt_barrier().
 */
#ifndef BT_WRITER_H
#define BT_WRITER_H

#define bt_barrier() __asm__ __volatile__("" ::: "memory")
#define bt_full_barrier() __asm__ __volatile__("mfence" ::: "memory")
#define BT_HDR64(w, off) (*(volatile uint64_t *)((w)->base + (off)))
#define BT_HDR32(w, off) (*(volatile uint32_t *)((w)->base + (off)))

struct bt_writer {
  uint8_t *base;        /* the whole mapping: header page first */
  uint64_t *data;       /* the ring data area */
  uint64_t size, mask, chunk;
  uint64_t head;        /* private copy of data_head */
  uint64_t claim_end;   /* end of the chunk we may write into */
  uint64_t pending_lost;
  uint32_t mode;
  int publish_each;     /* publish data_head after every record (else at chunk claims) */
  int zero_chunks;      /* zero each claimed chunk (else the includer keeps inline_ptr) */
  int fd;               /* the store file, for bt_consumer_alive */
};

static int bt_consumer_alive(struct bt_writer *w);

/* Returns 0, or -1 if `mapping` is not a ring of this format version. */
static int bt_writer_init(struct bt_writer *w, void *mapping, int fd, int publish_each,
                          uint32_t pid) {
  w->base = (uint8_t *)mapping;
  w->fd = fd;
  if (BT_HDR64(w, BT_OFF_MAGIC) != BT_MAGIC || BT_HDR32(w, BT_OFF_VERSION) != BT_VERSION)
    return -1;
  w->data = (uint64_t *)(w->base + BT_HDR64(w, BT_OFF_DATA_OFFSET));
  w->size = BT_HDR64(w, BT_OFF_DATA_SIZE);
  w->mask = w->size - 1;
  w->chunk = BT_HDR64(w, BT_OFF_CHUNK_SIZE);
  w->mode = BT_HDR32(w, BT_OFF_MODE);
  w->head = BT_HDR64(w, BT_OFF_DATA_HEAD);
  w->claim_end = BT_HDR64(w, BT_OFF_CLAIM_END);
  w->pending_lost = 0;
  w->publish_each = publish_each;
  w->zero_chunks = 1;
  BT_HDR64(w, BT_OFF_INLINE_BASE) = 0;
  /* never write into a chunk an earlier writer claimed: start at the next boundary */
  while (w->head < w->claim_end) {
    w->data[(w->head & w->mask) / 8] = BT_ESCAPE_BIT; /* PAD */
    w->head += 8;
  }
  BT_HDR64(w, BT_OFF_DATA_HEAD) = w->head;
  BT_HDR32(w, BT_OFF_WRITER_PID) = pid;
  BT_HDR32(w, BT_OFF_WRITER_STATE) = BT_WRITERSTATE_ACTIVE;
  return 0;
}

static void bt_wake_reader(struct bt_writer *w) {
  BT_HDR32(w, BT_OFF_HEAD_SEQ) = BT_HDR32(w, BT_OFF_HEAD_SEQ) + 1;
  bt_barrier();
  if (BT_HDR32(w, BT_OFF_READER_WAITING))
    bt_futex_wake((uint32_t *)(w->base + BT_OFF_HEAD_SEQ));
}

static void bt_publish(struct bt_writer *w) {
  bt_barrier();
  BT_HDR64(w, BT_OFF_DATA_HEAD) = w->head;
}

/* Wait for the consumer to free the chunk ending at `end`.  0, or -1 if the consumer is
   gone (it died or was killed): then the ring turns into a drop ring, so a traced program
   is never left waiting for a tool that no longer exists. */
static int bt_wait_for_space(struct bt_writer *w, uint64_t end) {
  BT_HDR64(w, BT_OFF_WRITER_WAITS) = BT_HDR64(w, BT_OFF_WRITER_WAITS) + 1;
  for (int round = 0;; round++) {
    uint32_t seq = BT_HDR32(w, BT_OFF_TAIL_SEQ);
    BT_HDR32(w, BT_OFF_WRITER_WAITING) = 1;
    bt_full_barrier(); /* the flag must be visible before we re-read data_tail */
    if (end - BT_HDR64(w, BT_OFF_DATA_TAIL) <= w->size)
      break;
    bt_publish(w);
    bt_wake_reader(w);
    if (BT_HDR32(w, BT_OFF_CONSUMER_PID) && BT_HDR32(w, BT_OFF_NOTIFY_SIGNAL))
      bt_notify(BT_HDR32(w, BT_OFF_CONSUMER_PID), BT_HDR32(w, BT_OFF_NOTIFY_SIGNAL));
    if (round > 0 && !bt_consumer_alive(w)) {
      BT_HDR32(w, BT_OFF_WRITER_WAITING) = 0;
      w->mode = BT_MODE_DROP;
      BT_HDR32(w, BT_OFF_MODE) = BT_MODE_DROP;
      return -1;
    }
    bt_futex_wait((uint32_t *)(w->base + BT_OFF_TAIL_SEQ), seq, 100000000L);
  }
  BT_HDR32(w, BT_OFF_WRITER_WAITING) = 0;
  return 0;
}

/* Claim the chunk at head (a chunk boundary).  0, or -1 when drop mode must drop. */
static int bt_claim(struct bt_writer *w) {
  uint64_t end = w->head + w->chunk;
  if (w->mode == BT_MODE_WRAP) {
    if (end > w->size && end - w->size > BT_HDR64(w, BT_OFF_DATA_TAIL))
      BT_HDR64(w, BT_OFF_DATA_TAIL) = end - w->size;
    bt_barrier();
  } else if (end - BT_HDR64(w, BT_OFF_DATA_TAIL) > w->size) {
    if (w->mode == BT_MODE_DROP || bt_wait_for_space(w, end)) {
      bt_publish(w);
      return -1;
    }
  }
  /* zeroed, so that a late reader finds where the words end; libc's memset, because a
     loop compiled by the CModule's TinyCC costs about a nanosecond per record.  An
     includer that publishes its write pointer in inline_ptr skips this: zeroing 64 KiB
     per 8192 records cost the stalker engine 15-25% of its recording time. */
  if (w->zero_chunks)
    memset(w->data + (w->head & w->mask) / 8, 0, w->chunk);
  w->claim_end = end;
  bt_barrier();
  BT_HDR64(w, BT_OFF_CLAIM_END) = end;
  bt_publish(w);
  bt_wake_reader(w);
  return 0;
}

static int bt_reserve(struct bt_writer *w, unsigned n) {
  if (w->head + 8ULL * n <= w->claim_end)
    return 0;
  while (w->head < w->claim_end) {
    w->data[(w->head & w->mask) / 8] = BT_ESCAPE_BIT; /* PAD */
    w->head += 8;
  }
  return bt_claim(w);
}

static void bt_store(struct bt_writer *w, const uint64_t *words, unsigned n) {
  uint64_t *p = w->data + (w->head & w->mask) / 8;
  for (unsigned i = 1; i < n; i++)
    p[i] = words[i];
  bt_barrier(); /* payload before header: a torn record has a zero header */
  p[0] = words[0];
  w->head += 8ULL * n;
  if (w->publish_each)
    bt_publish(w);
}

static void bt_lose(struct bt_writer *w, uint64_t n) {
  w->pending_lost += n;
  BT_HDR64(w, BT_OFF_LOST_RECORDS) = BT_HDR64(w, BT_OFF_LOST_RECORDS) + n;
}

static int bt_flush_lost(struct bt_writer *w, unsigned then_words) {
  uint64_t lost[2] = {BT_ESCAPE_BIT | ((uint64_t)BT_RECORDTYPE_LOST << BT_TYPE_SHIFT) |
                          (1ULL << BT_LEN_SHIFT),
                      w->pending_lost & BT_PAYLOAD_MASK};
  if (bt_reserve(w, 2 + then_words))
    return -1;
  bt_store(w, lost, 2);
  BT_HDR64(w, BT_OFF_LOST_EVENTS) = BT_HDR64(w, BT_OFF_LOST_EVENTS) + 1;
  w->pending_lost = 0;
  return 0;
}

/* Write one encoded record of 1..BT_MAX_RING_PAYLOAD+1 words.  0, or -1 if dropped. */
static int bt_write(struct bt_writer *w, const uint64_t *words, unsigned n) {
  if ((w->pending_lost && bt_flush_lost(w, n)) || bt_reserve(w, n)) {
    bt_lose(w, 1);
    return -1;
  }
  bt_store(w, words, n);
  return 0;
}

static inline uint64_t bt_escape(uint64_t type, uint64_t nwords, uint64_t arg) {
  return BT_ESCAPE_BIT | (type << BT_TYPE_SHIFT) | (nwords << BT_LEN_SHIFT) | arg;
}

/* A BLOCK record: a block of code starting at `start` whose last instruction is at
   start + last_off.  Starts beyond 47 bits take the BLOCK_FAR form. */
static inline int bt_block(struct bt_writer *w, uint64_t start, uint64_t last_off) {
  if (start >> BT_BLOCK_ADDR_BITS) {
    uint64_t far[2] = {bt_escape(BT_RECORDTYPE_BLOCK_FAR, 1, last_off), start & BT_PAYLOAD_MASK};
    return bt_write(w, far, 2);
  }
  uint64_t word = start | (last_off << BT_BLOCK_ADDR_BITS);
  return bt_write(w, &word, 1);
}

static inline int bt_branch(struct bt_writer *w, uint64_t kind, uint64_t from, uint64_t to) {
  uint64_t rec[3] = {bt_escape(BT_RECORDTYPE_BRANCH, 2, kind), from & BT_PAYLOAD_MASK,
                     to & BT_PAYLOAD_MASK};
  return bt_write(w, rec, 3);
}

static void bt_writer_flush(struct bt_writer *w) {
  bt_publish(w);
  bt_wake_reader(w);
}

static void bt_writer_close(struct bt_writer *w) {
  if (w->pending_lost)
    bt_flush_lost(w, 0);
  bt_publish(w);
  BT_HDR32(w, BT_OFF_WRITER_STATE) = BT_WRITERSTATE_CLOSED;
  bt_wake_reader(w);
}

#endif
