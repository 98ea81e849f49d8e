// A shared-memory communicator for tensor-parallel ranks on one machine (verispec/kernels/comm.py wraps it): gloo
// costs a millisecond per small all-reduce, a decode step makes two per layer.
//
// The segment (a /dev/shm file every rank maps): a global line (magic, world, cap, closed flag), then per rank 256
// bytes (its sequence counter alone on a cache line, its pid, the per-slot description of its gather block), then
// the data buffers [2][world][stride] floats. Every op k (counted the same on every rank) is a full barrier: a rank
// writes its part into slot k & 1, row rank, publishes seq[rank] = k (release), waits until every seq >= k
// (acquire) and reads what it needs. Two slots suffice: a rank writes slot k & 1 again at op k + 2, after passing
// op k + 1's barrier, which every rank enters only after it has read op k.
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels.h"

#define MAGIC 0x766572697370636dLL  // "verispcm"
#define LINE 64
#define RANK_BYTES 256
#define SPIN_NS 50000LL        // busy-wait this long: a peer on another core answers within microseconds
#define YIELD_NS 2000000LL     // then yield (more ranks than free cores: let the late one run)
#define SLEEP_MIN_NS 20000LL   // then sleep, backing off to SLEEP_MAX_NS (an idle worker costs nothing)
#define SLEEP_MAX_NS 1000000LL
#define CHECK_NS 100000000LL   // how often a slow waiter looks for dead peers, the closed flag and the timeout

typedef struct {
    int64_t magic, world, cap;
    _Atomic int32_t closed;
} Global;

typedef struct {
    _Alignas(LINE) _Atomic int64_t seq;
    _Alignas(LINE) _Atomic int64_t pid;
    // per slot, the rank's gather block: flat start and count of this op's piece, width, column, total floats
    _Alignas(LINE) int64_t meta[2][8];
} RankHeader;

_Static_assert(sizeof(Global) <= LINE, "the global header fits one line");
_Static_assert(sizeof(RankHeader) == RANK_BYTES, "a rank's header is 256 bytes");

typedef struct ShmComm {
    int32_t rank, world;
    int64_t cap;     // floats per rank and op
    int64_t stride;  // cap rounded up to whole cache lines
    uint8_t *base;
    int64_t ops;     // ops done by this rank (the next one is ops + 1)
    double timeout_s;
    int32_t failed;     // 0, or what every later op returns
    int32_t dead_rank;  // the peer found dead, or -1
} ShmComm;

static inline int64_t stride_of(int64_t cap) { return (cap + LINE / 4 - 1) / (LINE / 4) * (LINE / 4); }

static inline Global *global(const ShmComm *c) { return (Global *)c->base; }

static inline RankHeader *rank_header(const ShmComm *c, int32_t r) {
    return (RankHeader *)(c->base + LINE + (int64_t)r * RANK_BYTES);
}

static inline float *buffer(const ShmComm *c, int slot, int32_t r) {
    float *data = (float *)(c->base + LINE + (int64_t)c->world * RANK_BYTES);
    return data + ((int64_t)slot * c->world + r) * c->stride;
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

int64_t shm_comm_size(void) { return sizeof(ShmComm); }

int64_t shm_segment_bytes(int64_t world, int64_t cap) {
    return LINE + world * RANK_BYTES + 2 * world * stride_of(cap) * (int64_t)sizeof(float);
}

int32_t shm_comm_init(struct ShmComm *c, void *base, int32_t rank, int32_t world, int64_t cap, double timeout_s,
                      int32_t create) {
    if (world < 1 || rank < 0 || rank >= world || cap < 1) return -3;
    *c = (ShmComm){.rank = rank, .world = world, .cap = cap, .stride = stride_of(cap), .base = base,
                   .timeout_s = timeout_s, .dead_rank = -1};
    Global *g = global(c);
    if (create) {
        memset(base, 0, LINE + (size_t)world * RANK_BYTES);
        g->world = world;
        g->cap = cap;
        // last: an attaching rank that sees the magic sees the rest
        atomic_thread_fence(memory_order_release);
        g->magic = MAGIC;
    } else {
        if (g->magic != MAGIC || g->world != world || g->cap != cap) return -3;
        atomic_thread_fence(memory_order_acquire);
    }
    atomic_store_explicit(&rank_header(c, rank)->pid, (int64_t)getpid(), memory_order_relaxed);
    return 0;
}

int32_t shm_comm_dead_rank(void *cv) { return ((ShmComm *)cv)->dead_rank; }

void shm_close(void *cv) {
    ShmComm *c = cv;
    atomic_store_explicit(&global(c)->closed, 1, memory_order_release);
}

// A process that exited: gone (ESRCH), or a zombie its parent has not reaped yet (still answers kill)
static int process_gone(int64_t pid) {
    if (kill((pid_t)pid, 0) == -1) return errno == ESRCH;
    char path[64], stat[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    ssize_t n = read(fd, stat, sizeof stat - 1);
    close(fd);
    if (n <= 0) return 0;
    stat[n] = 0;
    // "pid (comm) S ...": the state follows the last ')' (comm may hold one)
    char *p = strrchr(stat, ')');
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

static int32_t fail(ShmComm *c, int32_t rc) {
    c->failed = rc;
    return rc;
}

static int32_t op_begin(ShmComm *c) {
    if (c->failed) return c->failed;
    if (atomic_load_explicit(&global(c)->closed, memory_order_acquire)) return fail(c, -2);
    return 0;
}

// this rank's part of op k is in place: let the others see it
static inline void publish(ShmComm *c, int64_t k) {
    atomic_store_explicit(&rank_header(c, c->rank)->seq, k, memory_order_release);
}

static inline int all_arrived(const ShmComm *c, int64_t k, int32_t *r) {
    while (*r < c->world && atomic_load_explicit(&rank_header(c, *r)->seq, memory_order_acquire) >= k) (*r)++;
    return *r == c->world;
}

// Wait until every rank has published op k: 0, -1 (a peer died or timeout_s > 0 passed) or -2 (closed)
static int32_t wait_all(ShmComm *c, int64_t k, double timeout_s) {
    int32_t r = 0;
    if (all_arrived(c, k, &r)) return 0;
    const int64_t start = now_ns();
    const int64_t limit = timeout_s > 0 ? (int64_t)(timeout_s * 1e9) : INT64_MAX;
    int64_t next_check = start + CHECK_NS, sleep_ns = SLEEP_MIN_NS;
    int spinning = 1;
    for (uint64_t it = 1;; it++) {
        if (all_arrived(c, k, &r)) return 0;
        int64_t t;
        if (spinning) {
            cpu_relax();
            if (it & 255) continue;
            t = now_ns();
            if (t - start < SPIN_NS) continue;
            spinning = 0;
        } else {
            t = now_ns();
        }
        if (t >= next_check) {
            next_check = t + CHECK_NS;
            if (atomic_load_explicit(&global(c)->closed, memory_order_acquire))
                return all_arrived(c, k, &r) ? 0 : fail(c, -2);
            for (int32_t p = 0; p < c->world; p++) {
                int64_t pid = atomic_load_explicit(&rank_header(c, p)->pid, memory_order_relaxed);
                // pid 0: not attached yet (only the timeout applies)
                if (p != c->rank && pid > 0 && process_gone(pid)) {
                    c->dead_rank = p;
                    return fail(c, -1);
                }
            }
            if (t - start > limit) return fail(c, -1);
        }
        if (t - start < YIELD_NS) {
            sched_yield();
        } else {
            struct timespec d = {0, sleep_ns};
            nanosleep(&d, NULL);
            sleep_ns = sleep_ns * 2 < SLEEP_MAX_NS ? sleep_ns * 2 : SLEEP_MAX_NS;
        }
    }
}

int32_t shm_barrier(void *cv) {
    ShmComm *c = cv;
    int32_t rc = op_begin(c);
    if (rc) return rc;
    int64_t k = ++c->ops;
    publish(c, k);
    return wait_all(c, k, c->timeout_s);
}

// Every rank ends with the sum over ranks in rank order 0, 1, .., world - 1: the same bits everywhere
int32_t shm_allreduce_f32(void *cv, float *x, int64_t n) {
    ShmComm *c = cv;
    int32_t rc = op_begin(c);
    if (rc) return rc;
    int64_t done = 0;
    do {
        int64_t k = ++c->ops, m = n - done < c->cap ? n - done : c->cap;
        int slot = (int)(k & 1);
        if (m) memcpy(buffer(c, slot, c->rank), x + done, (size_t)m * sizeof(float));
        publish(c, k);
        if ((rc = wait_all(c, k, c->timeout_s))) return rc;
        if (!m) break;
        float *restrict y = x + done;
        memcpy(y, buffer(c, slot, 0), (size_t)m * sizeof(float));
        for (int32_t r = 1; r < c->world; r++) {
            const float *restrict b = buffer(c, slot, r);
            for (int64_t i = 0; i < m; i++) y[i] += b[i];
        }
        done += m;
    } while (done < n);
    return 0;
}

// Rank 0 places rank r's piece (flat floats [start, start + count) of its rows x width block) at column col of out
static void place(const int64_t *meta, const float *src, float *out, int64_t out_stride) {
    int64_t i = meta[0], end = meta[0] + meta[1], width = meta[2], col = meta[3];
    while (i < end) {
        int64_t row = i / width, j = i % width, m = width - j < end - i ? width - j : end - i;
        memcpy(out + row * out_stride + col + j, src, (size_t)m * sizeof(float));
        src += m;
        i += m;
    }
}

// Each rank's x [rows, width] (its own width) into rank 0's out [rows, out_stride] at column col (the rank's own);
// a block goes in flat pieces of at most cap floats, as many ops as the largest block needs: after each op every
// rank sees from every rank's description whether anyone has more
int32_t shm_gather_f32(void *cv, const float *x, int64_t rows, int64_t width, float *out, int64_t out_stride,
                       int64_t col) {
    ShmComm *c = cv;
    int32_t rc = op_begin(c);
    if (rc) return rc;
    const int64_t total = rows * width;
    int64_t done = 0, more;
    do {
        int64_t k = ++c->ops, m = total - done < c->cap ? total - done : c->cap;
        int slot = (int)(k & 1);
        if (m) memcpy(buffer(c, slot, c->rank), x + done, (size_t)m * sizeof(float));
        int64_t *meta = rank_header(c, c->rank)->meta[slot];
        meta[0] = done;
        meta[1] = m;
        meta[2] = width;
        meta[3] = col;
        meta[4] = total;
        publish(c, k);
        if ((rc = wait_all(c, k, c->timeout_s))) return rc;
        more = 0;
        for (int32_t r = 0; r < c->world; r++) {
            const int64_t *mr = rank_header(c, r)->meta[slot];
            if (c->rank == 0 && out && mr[1] > 0) place(mr, buffer(c, slot, r), out, out_stride);
            more |= mr[0] + mr[1] < mr[4];
        }
        done += m;
    } while (more);
    return 0;
}

// Rank 0's nbytes of data into every rank's data; timeout_s <= 0 waits for ever (a worker idle between requests),
// yet still returns -1 when a peer died and -2 when the channel is closed
int32_t shm_broadcast(void *cv, void *data, int64_t nbytes, double timeout_s) {
    ShmComm *c = cv;
    int32_t rc = op_begin(c);
    if (rc) return rc;
    const int64_t cap = c->cap * (int64_t)sizeof(float);
    int64_t done = 0;
    do {
        int64_t k = ++c->ops, m = nbytes - done < cap ? nbytes - done : cap;
        int slot = (int)(k & 1);
        if (c->rank == 0 && m) memcpy(buffer(c, slot, 0), (uint8_t *)data + done, (size_t)m);
        publish(c, k);
        if ((rc = wait_all(c, k, timeout_s))) return rc;
        if (c->rank != 0 && m) memcpy((uint8_t *)data + done, buffer(c, slot, 0), (size_t)m);
        done += m;
    } while (done < nbytes);
    return 0;
}
