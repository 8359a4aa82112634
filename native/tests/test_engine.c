/*
 * Tests of the streamer engine (native/include/streamer_engine.h).
 *
 * A plain program: each test calls CHECK, which prints the failed expression
 * with file:line and exits 1. Every test makes its own temporary files with
 * mkstemp in $TMPDIR (or /tmp) and removes them. On success the last line is
 * "engine tests: N passed, 0 failed".
 */
#define _GNU_SOURCE
#include "streamer_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int g_passed;                   /* the test counter */
static atomic_int g_team_members;      /* members fake_team ran: the only other mutable global */

#define CHECK(expr)                                                                   \
    do {                                                                              \
        if (!(expr)) {                                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #expr);  \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

/* Like CHECK(a == b) for integers, but also prints both values. */
#define CHECK_EQ(a, b)                                                                \
    do {                                                                              \
        long long a_ = (long long)(a);                                                \
        long long b_ = (long long)(b);                                                \
        if (a_ != b_) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s == %s (%lld vs %lld)\n", __FILE__, \
                    __LINE__, #a, #b, a_, b_);                                        \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

#define RUN(test)                                \
    do {                                         \
        test();                                  \
        g_passed++;                              \
        printf("ok %s\n", #test);                \
        fflush(stdout);                          \
    } while (0)

#define KIB ((uint64_t)1024)
#define MIB ((uint64_t)1024 * 1024)
#define WAIT_LIMIT_SECONDS 120.0 /* generous: TSan is slow on 2 cores */

/* ---------------------------------------------------------------- helpers */

static double now_seconds(void) {
    struct timespec ts;
    CHECK(clock_gettime(CLOCK_MONOTONIC, &ts) == 0);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
        CHECK(errno == EINTR);
    }
}

static uint64_t rng_next(uint64_t *state) {
    uint64_t x = *state; /* xorshift64 */
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    return x;
}

static unsigned char *random_bytes(size_t size, uint64_t seed) {
    unsigned char *data = malloc(size > 0 ? size : 1);
    CHECK(data != NULL);
    uint64_t state = seed | 1;
    for (size_t i = 0; i < size; i++) {
        data[i] = (unsigned char)(rng_next(&state) >> 56);
    }
    return data;
}

static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }
static uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }

typedef struct temp_file {
    char path[4096];
    int fd; /* open read-write until temp_remove */
} temp_file;

static void write_all(int fd, const unsigned char *data, size_t size) {
    size_t done = 0;
    while (done < size) {
        ssize_t n = write(fd, data + done, size - done);
        if (n < 0) {
            CHECK(errno == EINTR);
            continue;
        }
        CHECK(n > 0);
        done += (size_t)n;
    }
}

static void temp_create(temp_file *t, const unsigned char *data, size_t size) {
    const char *dir = getenv("TMPDIR");
    if (dir == NULL || dir[0] == '\0') {
        dir = "/tmp";
    }
    int n = snprintf(t->path, sizeof(t->path), "%s/streamer-engine-test-XXXXXX", dir);
    CHECK(n > 0 && (size_t)n < sizeof(t->path));
    t->fd = mkstemp(t->path);
    CHECK(t->fd >= 0);
    write_all(t->fd, data, size);
}

static void temp_remove(temp_file *t) {
    CHECK(close(t->fd) == 0);
    CHECK(unlink(t->path) == 0);
}

static se_engine *engine_new(uint32_t n_workers, const se_unit *units, uint32_t n_units) {
    int32_t status = 12345;
    se_engine *e = se_engine_create(n_workers, units, n_units, &status);
    CHECK(e != NULL);
    return e;
}

/* Adds a file that must open; returns its index and stores is_direct if asked. */
static int32_t engine_add(se_engine *e, const char *path, int32_t want_direct, int32_t *is_direct) {
    int32_t direct = -1;
    int32_t sys_errno = -1;
    int32_t index = se_engine_add_file(e, path, want_direct, &direct, &sys_errno);
    CHECK(index >= 0);
    CHECK(direct == 0 || direct == 1);
    if (!want_direct) {
        CHECK_EQ(direct, 0);
    }
    if (is_direct != NULL) {
        *is_direct = direct;
    }
    return index;
}

/*
 * Waits until `want` more units are reported; marks each in seen[] and fails
 * on an error, an id out of range, an id reported twice, or no progress.
 */
static void collect(se_engine *e, uint8_t *seen, uint32_t n_units, uint32_t want, size_t max_ids) {
    uint32_t ids[64];
    CHECK(max_ids >= 1 && max_ids <= 64);
    uint32_t got = 0;
    double deadline = now_seconds() + WAIT_LIMIT_SECONDS;
    while (got < want) {
        size_t n = 9999;
        int32_t rc = se_engine_wait(e, ids, max_ids, 200, &n);
        CHECK_EQ(rc, SE_OK);
        CHECK(n <= max_ids);
        for (size_t i = 0; i < n; i++) {
            CHECK(ids[i] < n_units);
            CHECK_EQ(seen[ids[i]], 0);
            seen[ids[i]] = 1;
            got++;
        }
        CHECK(now_seconds() < deadline);
    }
}

/* Checks that no unit gets reported within timeout_ms. */
static void expect_quiet(se_engine *e, int32_t timeout_ms) {
    uint32_t ids[8];
    size_t n = 9999;
    CHECK_EQ(se_engine_wait(e, ids, 8, timeout_ms, &n), SE_OK);
    CHECK_EQ(n, 0);
}

/* Waits until se_engine_wait fails and returns its code (ids reported before are ignored). */
static int32_t wait_for_error(se_engine *e) {
    uint32_t ids[64];
    double deadline = now_seconds() + WAIT_LIMIT_SECONDS;
    for (;;) {
        size_t n = 9999;
        int32_t rc = se_engine_wait(e, ids, 64, 200, &n);
        if (rc != SE_OK) {
            return rc;
        }
        CHECK(now_seconds() < deadline);
    }
}

static void wait_blocks_done(se_engine *e, uint64_t n_blocks) {
    double deadline = now_seconds() + WAIT_LIMIT_SECONDS;
    for (;;) {
        se_stats stats;
        se_engine_stats(e, &stats);
        CHECK(stats.blocks_done <= n_blocks);
        if (stats.blocks_done == n_blocks) {
            return;
        }
        CHECK(now_seconds() < deadline);
        sleep_ms(1);
    }
}

/* A block that reads exactly the credited range [begin, end) into base + begin. */
static se_block plain_block(int32_t file, uint32_t first, uint32_t last, uint64_t begin,
                            uint64_t end, unsigned char *base) {
    se_block b = {file, first, last, 0, begin, end, begin, end - begin, base + begin};
    return b;
}

/*
 * Sorted, disjoint units over [0, size) of one file: tiny, medium and big
 * (spanning many blocks), often adjacent, sometimes with gaps; the last one
 * ends at EOF. Returns how many were written to units[].
 */
static uint32_t make_units(se_unit *units, uint32_t cap, int32_t file, uint64_t size,
                           uint64_t *rng) {
    uint32_t n = 0;
    uint64_t pos = 0;
    while (n < cap) {
        if (rng_next(rng) % 2 == 0) {
            pos += rng_next(rng) % 5000;
        }
        if (pos >= size) {
            break;
        }
        uint64_t len;
        switch (rng_next(rng) % 4) {
        case 0: len = 1 + rng_next(rng) % 16; break;
        case 1: len = 1 + rng_next(rng) % 4096; break;
        case 2: len = 1 + rng_next(rng) % 100000; break;
        default: len = 1 + rng_next(rng) % (3 * MIB); break;
        }
        uint64_t end = min_u64(pos + len, size);
        se_unit u = {file, pos, end, 0};
        units[n++] = u;
        pos = end;
    }
    CHECK(n > 0);
    units[n - 1].end = size;
    return n;
}

/*
 * Cuts [0, size) of a file into block_size chunks and makes one block per
 * chunk that overlaps units[first..end). The credited range is the chunk
 * clipped to those units; the read is either that range or the whole chunk.
 * dst mirrors the file: byte k of the file lands at base[k].
 */
static size_t plan_blocks(const se_unit *units, uint32_t first, uint32_t end, uint64_t size,
                          uint64_t block_size, int whole_chunks, unsigned char *base,
                          se_block *out) {
    size_t n = 0;
    uint32_t i = first;
    for (uint64_t c0 = 0; c0 < size; c0 += block_size) {
        uint64_t c1 = min_u64(c0 + block_size, size);
        while (i < end && units[i].end <= c0) {
            i++;
        }
        if (i == end || units[i].begin >= c1) {
            continue;
        }
        uint32_t j = i;
        while (j + 1 < end && units[j + 1].begin < c1) {
            j++;
        }
        se_block b = {0};
        b.file = units[i].file;
        b.first_unit = i;
        b.last_unit = j;
        b.acc_begin = max_u64(c0, units[i].begin);
        b.acc_end = min_u64(c1, units[j].end);
        b.read_offset = whole_chunks ? c0 : b.acc_begin;
        b.read_length = (whole_chunks ? c1 : b.acc_end) - b.read_offset;
        b.dst = base + b.read_offset;
        out[n++] = b;
    }
    return n;
}

static void shuffle_blocks(se_block *blocks, size_t n, uint64_t *rng) {
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)(rng_next(rng) % i);
        se_block tmp = blocks[i - 1];
        blocks[i - 1] = blocks[j];
        blocks[j] = tmp;
    }
}

/* ------------------------------------------------------------------ tests */

/* 1. Many units and blocks of several sizes, 1..16 workers: every unit once, bytes equal. */
static void test_read_many_units(void) {
    const uint64_t size_a = 9 * MIB + 123;
    const uint64_t size_b = 777;
    unsigned char *data_a = random_bytes(size_a, 1);
    unsigned char *data_b = random_bytes(size_b, 2);
    temp_file fa, fb;
    temp_create(&fa, data_a, size_a);
    temp_create(&fb, data_b, size_b);

    enum { UNIT_CAP = 4096 };
    se_unit *units = malloc(UNIT_CAP * sizeof(*units));
    CHECK(units != NULL);
    uint64_t rng = 12345;
    uint32_t n_a = make_units(units, UNIT_CAP - 64, 0, size_a, &rng);
    uint32_t n_units = n_a + make_units(units + n_a, 64, 1, size_b, &rng);

    unsigned char *dst_a = malloc(size_a);
    unsigned char *dst_b = malloc(size_b);
    uint8_t *seen = malloc(n_units);
    size_t block_cap = (size_t)(size_a / 4096 + size_b / 4096 + 4);
    se_block *blocks = malloc(block_cap * sizeof(*blocks));
    CHECK(dst_a != NULL && dst_b != NULL && seen != NULL && blocks != NULL);

    const uint64_t block_sizes[] = {4096, 12345, MIB};
    const uint32_t worker_counts[] = {1, 2, 5, 16};
    const size_t max_ids[] = {1, 7, 64};
    int config = 0;
    for (size_t s = 0; s < sizeof(block_sizes) / sizeof(block_sizes[0]); s++) {
        for (size_t w = 0; w < sizeof(worker_counts) / sizeof(worker_counts[0]); w++, config++) {
            memset(dst_a, 0xA5, size_a);
            memset(dst_b, 0xA5, size_b);
            memset(seen, 0, n_units);
            int whole = config % 2;
            size_t n_blocks = plan_blocks(units, 0, n_a, size_a, block_sizes[s], whole, dst_a, blocks);
            n_blocks += plan_blocks(units, n_a, n_units, size_b, block_sizes[s], whole, dst_b,
                                    blocks + n_blocks);
            CHECK(n_blocks <= block_cap);
            if (config % 3 == 1) {
                shuffle_blocks(blocks, n_blocks, &rng);
            }

            se_engine *e = engine_new(worker_counts[w], units, n_units);
            CHECK_EQ(engine_add(e, fa.path, 0, NULL), 0);
            CHECK_EQ(engine_add(e, fb.path, 0, NULL), 1);
            size_t batch = config % 4 == 0 ? n_blocks : 97;
            for (size_t i = 0; i < n_blocks; i += batch) {
                CHECK_EQ(se_engine_submit(e, blocks + i, min_u64(batch, n_blocks - i)), SE_OK);
            }
            collect(e, seen, n_units, n_units, max_ids[config % 3]);
            expect_quiet(e, 20);

            se_error_info err;
            se_engine_error(e, &err);
            CHECK_EQ(err.code, SE_OK);
            se_engine_destroy(e);

            for (uint32_t u = 0; u < n_units; u++) {
                const unsigned char *src = units[u].file == 0 ? data_a : data_b;
                const unsigned char *dst = units[u].file == 0 ? dst_a : dst_b;
                CHECK(memcmp(dst + units[u].begin, src + units[u].begin,
                             units[u].end - units[u].begin) == 0);
            }
        }
    }

    free(blocks);
    free(seen);
    free(dst_b);
    free(dst_a);
    free(units);
    temp_remove(&fb);
    temp_remove(&fa);
    free(data_b);
    free(data_a);
}

/*
 * 2. Blocks straddling units credit only their overlap. U1 = [1000, 1300) is
 * covered by three blocks; b1 spills 1000 bytes into U0 and b3 2700 into U2,
 * so crediting whole blocks would complete U1 early.
 */
static void test_straddling_blocks(void) {
    const uint64_t size = 4000;
    unsigned char *data = random_bytes(size, 3);
    temp_file f;
    temp_create(&f, data, size);
    const se_unit units[3] = {{0, 0, 1000, 0}, {0, 1000, 1300, 0}, {0, 1300, 4000, 0}};
    unsigned char *dst = malloc(size);
    CHECK(dst != NULL);

    const uint32_t worker_counts[] = {1, 3};
    for (size_t w = 0; w < 2; w++) {
        for (int last = 0; last < 3; last++) { /* the block submitted on its own, at the end */
            memset(dst, 0, size);
            const se_block blocks[3] = {
                plain_block(0, 0, 1, 0, 1200, dst),
                plain_block(0, 1, 1, 1200, 1250, dst),
                plain_block(0, 1, 2, 1250, 4000, dst),
            };
            se_engine *e = engine_new(worker_counts[w], units, 3);
            CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
            for (int b = 0; b < 3; b++) {
                if (b != last) {
                    CHECK_EQ(se_engine_submit(e, &blocks[b], 1), SE_OK);
                }
            }
            /* U0 needs only b1 and U2 only b3; U1 needs all three. */
            uint8_t seen[3] = {0, 0, 0};
            uint32_t early = (last != 0) + (last != 2);
            collect(e, seen, 3, early, 1);
            wait_blocks_done(e, 2);
            expect_quiet(e, 50);
            CHECK_EQ(seen[0], last != 0);
            CHECK_EQ(seen[1], 0);
            CHECK_EQ(seen[2], last != 2);

            CHECK_EQ(se_engine_submit(e, &blocks[last], 1), SE_OK);
            collect(e, seen, 3, 3 - early, 3);
            expect_quiet(e, 20);
            CHECK(seen[0] && seen[1] && seen[2]);
            se_engine_destroy(e);
            CHECK(memcmp(dst, data, size) == 0);
        }
    }
    free(dst);
    temp_remove(&f);
    free(data);
}

/*
 * A sparse unit (need < end - begin) completes once its scattered ranges are read, whatever the
 * order; blocks may read a gathered layout (dst not at the file offset). need beyond the unit's
 * range is refused.
 */
static void test_sparse_unit(void) {
    const uint64_t size = 64 * KIB;
    unsigned char *data = random_bytes(size, 21);
    temp_file f;
    temp_create(&f, data, size);
    /* Unit 0: bytes [1000, 1500) and [40000, 40700) of [1000, 40700); unit 1 whole after it. */
    const se_unit units[2] = {{0, 1000, 40700, 500 + 700}, {0, 50000, 60000, 0}};
    unsigned char gathered[1200 + 10000];
    const se_block blocks[3] = {
        {0, 0, 0, 0, 1000, 1500, 1000, 500, gathered},
        {0, 0, 0, 0, 40000, 40700, 40000, 700, gathered + 500},
        {0, 1, 1, 0, 50000, 60000, 50000, 10000, gathered + 1200},
    };
    for (int first = 0; first < 2; first++) {
        memset(gathered, 0, sizeof(gathered));
        se_engine *e = engine_new(2, units, 2);
        CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
        CHECK_EQ(se_engine_submit(e, &blocks[first], 1), SE_OK);
        CHECK_EQ(se_engine_submit(e, &blocks[2], 1), SE_OK);
        uint8_t seen[2] = {0, 0};
        collect(e, seen, 2, 1, 4);
        wait_blocks_done(e, 2);
        expect_quiet(e, 50);
        CHECK_EQ(seen[0], 0); /* half of unit 0's ranges read: not complete */
        CHECK_EQ(se_engine_submit(e, &blocks[1 - first], 1), SE_OK);
        collect(e, seen, 2, 1, 4);
        CHECK(seen[0] && seen[1]);
        se_engine_destroy(e);
        CHECK(memcmp(gathered, data + 1000, 500) == 0);
        CHECK(memcmp(gathered + 500, data + 40000, 700) == 0);
        CHECK(memcmp(gathered + 1200, data + 50000, 10000) == 0);
    }
    const se_unit too_much[1] = {{0, 0, 4096, 4097}};
    int32_t status = SE_OK;
    CHECK(se_engine_create(1, too_much, 1, &status) == NULL);
    CHECK_EQ(status, SE_ERR_INVALID);
    temp_remove(&f);
    free(data);
}

/* A buffered file reads only a block's credited bytes (padding is O_DIRECT's); bytes_read counts them. */
static void test_buffered_reads_credited_only(void) {
    const uint64_t size = 16 * KIB;
    unsigned char *data = random_bytes(size, 22);
    temp_file f;
    temp_create(&f, data, size);
    const se_unit units[1] = {{0, 5000, 6000, 0}};
    unsigned char dst[8192];
    memset(dst, 0xAB, sizeof(dst));
    const se_block block = {0, 0, 0, 0, 5000, 6000, 4096, 8192, dst}; /* read range rounded out to 4 KiB */
    se_engine *e = engine_new(1, units, 1);
    CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
    CHECK_EQ(se_engine_submit(e, &block, 1), SE_OK);
    uint8_t seen[1] = {0};
    collect(e, seen, 1, 1, 4);
    se_stats stats;
    se_engine_stats(e, &stats);
    CHECK_EQ(stats.bytes_read, 1000);
    se_engine_destroy(e);
    CHECK(memcmp(dst + 904, data + 5000, 1000) == 0);
    for (size_t i = 0; i < sizeof(dst); i++) {
        CHECK(i >= 904 && i < 1904 ? 1 : dst[i] == 0xAB);
    }
    temp_remove(&f);
    free(data);
}

/* An O_DIRECT file reads aligned blocks directly and blocks off the alignment buffered, exactly. */
static void test_direct_file_reads_unaligned_blocks_buffered(void) {
    const uint64_t size = 5 * 4096;
    unsigned char *data = random_bytes(size, 23);
    temp_file f;
    temp_create(&f, data, size);
    CHECK(fsync(f.fd) == 0);
    const se_unit units[2] = {{0, 5000, 6000, 0}, {0, 8192, 12288, 0}};
    unsigned char *aligned = se_alloc(4096, 0);
    unsigned char odd[1001];
    CHECK(aligned != NULL);
    const se_block blocks[2] = {
        {0, 0, 0, 0, 5000, 6000, 5000, 1000, odd + 1},
        {0, 1, 1, 0, 8192, 12288, 8192, 4096, aligned},
    };
    se_engine *e = engine_new(2, units, 2);
    CHECK_EQ(engine_add(e, f.path, 1, NULL), 0);
    CHECK_EQ(se_engine_submit(e, blocks, 2), SE_OK);
    uint8_t seen[2] = {0, 0};
    collect(e, seen, 2, 2, 4);
    se_engine_destroy(e);
    CHECK(memcmp(odd + 1, data + 5000, 1000) == 0);
    CHECK(memcmp(aligned, data + 8192, 4096) == 0);
    se_free(aligned, 4096, 0);
    temp_remove(&f);
    free(data);
}

/* 3. O_DIRECT: aligned reads into se_alloc memory; the last read runs past EOF. */
static void test_direct_io(void) {
    const uint64_t size = 3 * 4096 + 100;
    unsigned char *data = random_bytes(size, 4);
    temp_file f;
    temp_create(&f, data, size);
    CHECK(fsync(f.fd) == 0);
    const se_unit units[2] = {{0, 5000, 9000, 0}, {0, 9000, size, 0}};
    const size_t dst_size = 4 * 4096;
    unsigned char *dst = se_alloc(dst_size, 0);
    CHECK(dst != NULL);
    CHECK((uintptr_t)dst % 4096 == 0);

    for (uint32_t workers = 1; workers <= 2; workers++) {
        memset(dst, 0, dst_size);
        se_engine *e = engine_new(workers, units, 2);
        int32_t is_direct = -1;
        CHECK_EQ(engine_add(e, f.path, 1, &is_direct), 0);
        /* The planner rounds reads out to 4096: [4096, 8192) and [8192, 16384), past EOF. */
        const se_block blocks[2] = {
            {0, 0, 0, 0, 5000, 8192, 4096, 4096, dst + 4096},
            {0, 0, 1, 0, 8192, size, 8192, 8192, dst + 8192},
        };
        CHECK_EQ(se_engine_submit(e, blocks, 2), SE_OK);
        uint8_t seen[2] = {0, 0};
        collect(e, seen, 2, 2, 2);
        expect_quiet(e, 20);
        se_stats stats;
        se_engine_stats(e, &stats);
        CHECK_EQ(stats.blocks_done, 2);
        CHECK_EQ(stats.bytes_read, size - 4096);
        se_engine_destroy(e);
        CHECK(memcmp(dst + 5000, data + 5000, size - 5000) == 0);
    }

    /* A direct read whose credited range passes EOF is truncated. */
    {
        const se_unit past[1] = {{0, 8192, size + 1, 0}};
        se_engine *e = engine_new(2, past, 1);
        CHECK_EQ(engine_add(e, f.path, 1, NULL), 0);
        const se_block block = {0, 0, 0, 0, 8192, size + 1, 8192, 8192, dst + 8192};
        CHECK_EQ(se_engine_submit(e, &block, 1), SE_OK);
        CHECK_EQ(wait_for_error(e), SE_ERR_TRUNCATED);
        se_error_info err;
        se_engine_error(e, &err);
        CHECK_EQ(err.code, SE_ERR_TRUNCATED);
        CHECK_EQ(err.file, 0);
        CHECK_EQ(err.offset, 8192);
        CHECK_EQ(err.expected, size + 1 - 8192);
        CHECK_EQ(err.got, size - 8192);
        se_engine_destroy(e);
    }

    se_free(dst, dst_size, 0);
    temp_remove(&f);
    free(data);
}

/*
 * 4. A block beyond EOF: SE_ERR_TRUNCATED with the failing read described.
 * The short file is the engine's second file, so the index is checked too.
 */
static void test_truncated_file(void) {
    const uint64_t size = 10000;
    unsigned char *data = random_bytes(size, 5);
    temp_file other, f;
    temp_create(&other, data, 100);
    temp_create(&f, data, size);
    unsigned char *dst = malloc(32 * KIB);
    CHECK(dst != NULL);

    /* Each case: the block's read range, and what got must be. */
    const uint64_t begins[2] = {8192, 20000};
    const uint64_t ends[2] = {12288, 24096};
    const uint64_t gots[2] = {size - 8192, 0};
    for (int c = 0; c < 2; c++) {
        const se_unit units[2] = {{1, 0, 4096, 0}, {1, begins[c], ends[c], 0}};
        se_engine *e = engine_new(2, units, 2);
        CHECK_EQ(engine_add(e, other.path, 0, NULL), 0);
        CHECK_EQ(engine_add(e, f.path, 0, NULL), 1);
        const se_block ok = plain_block(1, 0, 0, 0, 4096, dst);
        CHECK_EQ(se_engine_submit(e, &ok, 1), SE_OK);
        uint8_t seen[2] = {0, 0};
        collect(e, seen, 2, 1, 4);
        CHECK_EQ(seen[0], 1);
        CHECK(memcmp(dst, data, 4096) == 0);

        const se_block bad = {1, 1, 1, 0, begins[c], ends[c], begins[c], ends[c] - begins[c],
                              dst + 8192};
        CHECK_EQ(se_engine_submit(e, &bad, 1), SE_OK);
        CHECK_EQ(wait_for_error(e), SE_ERR_TRUNCATED);
        size_t n = 9999;
        uint32_t ids[4];
        CHECK_EQ(se_engine_wait(e, ids, 4, 0, &n), SE_ERR_TRUNCATED); /* the error sticks */

        se_error_info err;
        se_engine_error(e, &err);
        CHECK_EQ(err.code, SE_ERR_TRUNCATED);
        CHECK_EQ(err.sys_errno, 0);
        CHECK_EQ(err.file, 1);
        CHECK_EQ(err.offset, begins[c]);
        CHECK_EQ(err.expected, ends[c] - begins[c]);
        CHECK_EQ(err.got, gots[c]);
        se_engine_destroy(e);
    }

    free(dst);
    temp_remove(&f);
    temp_remove(&other);
    free(data);
}

/* 5. The file shrinks (ftruncate) between two submit batches: truncated, no hang. */
static void test_file_shrinks_between_batches(void) {
    const uint64_t size = 64 * KIB;
    const uint64_t shrunk = 40000;
    unsigned char *data = random_bytes(size, 6);
    temp_file f;
    temp_create(&f, data, size);
    unsigned char *dst = malloc(size);
    CHECK(dst != NULL);
    const se_unit units[2] = {{0, 0, 32 * KIB, 0}, {0, 32 * KIB, size, 0}};

    se_engine *e = engine_new(3, units, 2);
    CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
    const se_block first[2] = {
        plain_block(0, 0, 0, 0, 16 * KIB, dst),
        plain_block(0, 0, 0, 16 * KIB, 32 * KIB, dst),
    };
    CHECK_EQ(se_engine_submit(e, first, 2), SE_OK);
    uint8_t seen[2] = {0, 0};
    collect(e, seen, 2, 1, 2);
    CHECK_EQ(seen[0], 1);
    CHECK(memcmp(dst, data, 32 * KIB) == 0);

    CHECK(ftruncate(f.fd, (off_t)shrunk) == 0);
    const se_block second = plain_block(0, 1, 1, 32 * KIB, size, dst);
    CHECK_EQ(se_engine_submit(e, &second, 1), SE_OK);
    CHECK_EQ(wait_for_error(e), SE_ERR_TRUNCATED);
    se_error_info err;
    se_engine_error(e, &err);
    CHECK_EQ(err.code, SE_ERR_TRUNCATED);
    CHECK_EQ(err.file, 0);
    CHECK_EQ(err.offset, 32 * KIB);
    CHECK_EQ(err.expected, size - 32 * KIB);
    CHECK_EQ(err.got, shrunk - 32 * KIB);
    se_engine_destroy(e);

    free(dst);
    temp_remove(&f);
    free(data);
}

/* 6. A missing file fails to open with ENOENT; malformed blocks are refused, none queued. */
static void test_invalid_arguments(void) {
    const uint64_t size = 8192;
    unsigned char *data = random_bytes(size, 7);
    temp_file f;
    temp_create(&f, data, size);
    unsigned char *dst = malloc(size);
    CHECK(dst != NULL);
    const se_unit units[2] = {{0, 0, 4096, 0}, {0, 4096, size, 0}};
    se_engine *e = engine_new(2, units, 2);

    char missing[4200];
    int len = snprintf(missing, sizeof(missing), "%s.missing", f.path);
    CHECK(len > 0 && (size_t)len < sizeof(missing));
    for (int32_t direct = 0; direct <= 1; direct++) {
        int32_t is_direct = -1;
        int32_t sys_errno = -1;
        CHECK_EQ(se_engine_add_file(e, missing, direct, &is_direct, &sys_errno), SE_ERR_OPEN);
        CHECK_EQ(sys_errno, ENOENT);
    }
    /* A FIFO (or a directory) in a file's place is refused at once: opening it must not block. */
    char fifo[4200];
    len = snprintf(fifo, sizeof(fifo), "%s.fifo", f.path);
    CHECK(len > 0 && (size_t)len < sizeof(fifo));
    CHECK_EQ(mkfifo(fifo, 0600), 0);
    const char *not_files[2] = {fifo, "/tmp"};
    for (int k = 0; k < 2; k++) {
        for (int32_t direct = 0; direct <= 1; direct++) {
            int32_t is_direct = -1;
            int32_t sys_errno = -1;
            CHECK_EQ(se_engine_add_file(e, not_files[k], direct, &is_direct, &sys_errno), SE_ERR_OPEN);
            CHECK_EQ(sys_errno, EINVAL);
            CHECK_EQ(is_direct, 0);
        }
    }
    CHECK_EQ(unlink(fifo), 0);
    CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);

    const se_block good = plain_block(0, 0, 0, 0, 4096, dst);
    se_block bad[8];
    for (int i = 0; i < 8; i++) {
        bad[i] = good;
    }
    bad[0].file = 1;        /* only file 0 exists */
    bad[1].file = -1;
    bad[2].last_unit = 2;   /* only units 0 and 1 exist */
    bad[3].first_unit = 2;
    bad[3].last_unit = 2;
    bad[4].first_unit = 1;  /* first > last */
    bad[4].last_unit = 0;
    bad[5].acc_end = 5000;  /* credited range ends after the read */
    bad[6].acc_begin = 4096; /* empty credited range */
    bad[7].acc_begin = 100; /* credited range starts before the read */
    bad[7].read_offset = 200;
    bad[7].read_length = 3896;
    for (int i = 0; i < 8; i++) {
        CHECK_EQ(se_engine_submit(e, &bad[i], 1), SE_ERR_INVALID);
    }
    /* A batch with one bad block is refused whole: the good one must not run. */
    const se_block mixed[2] = {good, bad[0]};
    CHECK_EQ(se_engine_submit(e, mixed, 2), SE_ERR_INVALID);
    expect_quiet(e, 50);

    /* The engine still works afterwards, and ran only these two blocks. */
    const se_block blocks[2] = {good, plain_block(0, 1, 1, 4096, size, dst)};
    CHECK_EQ(se_engine_submit(e, blocks, 2), SE_OK);
    uint8_t seen[2] = {0, 0};
    collect(e, seen, 2, 2, 4);
    expect_quiet(e, 20);
    se_stats stats;
    se_engine_stats(e, &stats);
    CHECK_EQ(stats.blocks_done, 2);
    CHECK(memcmp(dst, data, size) == 0);
    se_engine_destroy(e);

    free(dst);
    temp_remove(&f);
    free(data);
}

typedef struct waiter {
    se_engine *engine;
    int32_t rc;
    double seconds;
} waiter;

static void *waiter_main(void *arg) {
    waiter *w = arg;
    uint32_t ids[4];
    size_t n = 0;
    double start = now_seconds();
    w->rc = se_engine_wait(w->engine, ids, 4, 30000, &n);
    w->seconds = now_seconds() - start;
    return NULL;
}

/* 7. Cancel: queued blocks are dropped, waiters return SE_ERR_CANCELLED, destroy is prompt. */
static void test_cancel(void) {
    const uint64_t size = 16 * MIB;
    const uint64_t block = 16 * KIB;
    const uint32_t n_units = (uint32_t)(size / block);
    unsigned char *data = random_bytes(size, 8);
    temp_file f;
    temp_create(&f, data, size);
    unsigned char *dst = malloc(size);
    se_unit *units = malloc(n_units * sizeof(*units));
    se_block *blocks = malloc(n_units * sizeof(*blocks));
    CHECK(dst != NULL && units != NULL && blocks != NULL);
    for (uint32_t u = 0; u < n_units; u++) {
        se_unit unit = {0, u * block, (u + 1) * block, 0};
        units[u] = unit;
        blocks[u] = plain_block(0, u, u, unit.begin, unit.end, dst);
    }

    for (uint32_t workers = 1; workers <= 4; workers *= 2) {
        se_engine *e = engine_new(workers, units, n_units);
        CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
        CHECK_EQ(se_engine_submit(e, blocks, n_units), SE_OK);
        double start = now_seconds();
        se_engine_cancel(e);
        size_t n = 9999;
        uint32_t ids[4];
        CHECK_EQ(se_engine_wait(e, ids, 4, 1000, &n), SE_ERR_CANCELLED);
        CHECK_EQ(se_engine_wait(e, ids, 4, 0, &n), SE_ERR_CANCELLED);
        se_engine_destroy(e);
        CHECK(now_seconds() - start < 10.0);
    }

    /* A waiter blocked on a unit that never completes is woken by cancel. */
    {
        se_engine *e = engine_new(2, units, n_units);
        CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
        waiter w = {e, 12345, 0.0};
        pthread_t thread;
        CHECK(pthread_create(&thread, NULL, waiter_main, &w) == 0);
        sleep_ms(50);
        se_engine_cancel(e);
        CHECK(pthread_join(thread, NULL) == 0);
        CHECK_EQ(w.rc, SE_ERR_CANCELLED);
        CHECK(w.seconds < 10.0);
        se_engine_destroy(e);
    }

    free(blocks);
    free(units);
    free(dst);
    temp_remove(&f);
    free(data);
}

/* 8. Destroy with queued blocks and no wait; destroy(NULL); bad create arguments. */
static void test_create_destroy(void) {
    const uint64_t size = 4 * MIB;
    const uint64_t block = 4 * KIB;
    const uint32_t n_units = (uint32_t)(size / block);
    unsigned char *data = random_bytes(size, 9);
    temp_file f;
    temp_create(&f, data, size);
    unsigned char *dst = malloc(size);
    se_unit *units = malloc(n_units * sizeof(*units));
    se_block *blocks = malloc(n_units * sizeof(*blocks));
    CHECK(dst != NULL && units != NULL && blocks != NULL);
    for (uint32_t u = 0; u < n_units; u++) {
        se_unit unit = {0, u * block, (u + 1) * block, 0};
        units[u] = unit;
        blocks[u] = plain_block(0, u, u, unit.begin, unit.end, dst);
    }

    for (uint32_t workers = 1; workers <= 8; workers *= 2) {
        se_engine *e = engine_new(workers, units, n_units);
        CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
        CHECK_EQ(se_engine_submit(e, blocks, n_units), SE_OK);
        se_engine_destroy(e);
    }
    se_engine_destroy(engine_new(3, units, n_units)); /* never given a file */
    se_engine_destroy(NULL);

    int32_t status = 12345;
    CHECK(se_engine_create(0, units, n_units, &status) == NULL);
    CHECK_EQ(status, SE_ERR_INVALID);
    const se_unit empty[1] = {{0, 100, 100, 0}}; /* end must be > begin */
    status = 12345;
    CHECK(se_engine_create(2, empty, 1, &status) == NULL);
    CHECK_EQ(status, SE_ERR_INVALID);

    free(blocks);
    free(units);
    free(dst);
    temp_remove(&f);
    free(data);
}

/* 9. se_alloc/se_free, and se_resident_bytes on a read file, an empty file, a missing file. */
static void test_memory_and_residency(void) {
    const size_t sizes[2] = {1, 3 * MIB + 1};
    for (int32_t huge = 0; huge <= 1; huge++) {
        for (int s = 0; s < 2; s++) {
            unsigned char *p = se_alloc(sizes[s], huge);
            CHECK(p != NULL);
            CHECK((uintptr_t)p % (huge ? 2 * MIB : 4096) == 0);
            for (size_t i = 0; i < sizes[s]; i++) {
                p[i] = (unsigned char)(i * 7);
            }
            for (size_t i = 0; i < sizes[s]; i++) {
                CHECK(p[i] == (unsigned char)(i * 7));
            }
            se_free(p, sizes[s], huge);
        }
    }

    const uint64_t size = MIB + 5;
    unsigned char *data = random_bytes(size, 10);
    temp_file f;
    temp_create(&f, data, size);
    CHECK(lseek(f.fd, 0, SEEK_SET) == 0);
    unsigned char *back = malloc(size);
    CHECK(back != NULL);
    size_t done = 0;
    while (done < size) {
        ssize_t n = read(f.fd, back + done, size - done);
        CHECK(n > 0);
        done += (size_t)n;
    }
    CHECK(memcmp(back, data, size) == 0);
    uint64_t resident = 0;
    uint64_t total = 0;
    int32_t sys_errno = -1;
    CHECK_EQ(se_resident_bytes(f.path, 0, UINT64_MAX, 1, &resident, &total, &sys_errno), SE_OK);
    CHECK_EQ(total, size);
    CHECK(resident > 0 && resident <= size);

    char missing[4200];
    int len = snprintf(missing, sizeof(missing), "%s.missing", f.path);
    CHECK(len > 0 && (size_t)len < sizeof(missing));
    sys_errno = -1;
    CHECK_EQ(se_resident_bytes(missing, 0, UINT64_MAX, 1, &resident, &total, &sys_errno), SE_ERR_OPEN);
    CHECK_EQ(sys_errno, ENOENT);

    temp_file empty;
    temp_create(&empty, data, 0);
    resident = 1;
    total = 1;
    CHECK_EQ(se_resident_bytes(empty.path, 0, UINT64_MAX, 1, &resident, &total, &sys_errno), SE_OK);
    CHECK_EQ(total, 0);
    CHECK_EQ(resident, 0);
    CHECK_EQ(se_resident_bytes(f.path, 0, UINT64_MAX, 0, &resident, &total, &sys_errno), SE_ERR_INVALID);

    temp_remove(&empty);
    free(back);
    temp_remove(&f);
    free(data);
}

/* 9b. A sampled residency count equals the exact one when the cached part is whole windows:
 * the second half of an 8 MiB file is evicted (where the filesystem lets it be), so every
 * other 1 MiB window is looked at and each stands for the one after it. */
typedef struct pattern_writer {
    unsigned char *p;
    size_t size;
} pattern_writer;

static void *write_pattern_backwards(void *arg) {
    const pattern_writer *w = arg;
    for (size_t end = w->size; end > 0;) {
        size_t begin = end > 64 * KIB ? end - 64 * KIB : 0;
        for (size_t i = begin; i < end; i++) {
            w->p[i] = (unsigned char)(i * 13 + 1);
        }
        end = begin;
    }
    return NULL;
}

/* Whole-page blocks of a file over [0, size) (size past EOF rounded up to a page), block_size
 * apart, placed through the page fill; units as given. */
static size_t fill_blocks(const se_unit *units, uint32_t n_units, uint64_t size, uint64_t block_size,
                          unsigned char *base, se_block *out) {
    size_t n = plan_blocks(units, 0, n_units, size, block_size, 1, base, out);
    for (size_t i = 0; i < n; i++) {
        out[i].read_length = (out[i].read_length + 4095) / 4096 * 4096;
        out[i].flags = SE_BLOCK_FILL;
    }
    return n;
}

/* Whether this process maps path (/proc/self/maps names it). */
static int is_mapped(const char *path) {
    FILE *maps = fopen("/proc/self/maps", "r");
    CHECK(maps != NULL);
    char line[8192];
    int found = 0;
    while (!found && fgets(line, sizeof(line), maps) != NULL) {
        found = strstr(line, path) != NULL;
    }
    CHECK_EQ(fclose(maps), 0);
    return found;
}

/* KiB of this process's mappings of path that are resident (smaps "Rss"). */
static long mapped_rss_kib(const char *path) {
    FILE *smaps = fopen("/proc/self/smaps", "r");
    CHECK(smaps != NULL);
    char line[8192];
    int in_path = 0;
    long total = 0;
    while (fgets(line, sizeof(line), smaps) != NULL) {
        unsigned long start = 0;
        unsigned long end = 0;
        long kib = 0;
        if (sscanf(line, "%lx-%lx ", &start, &end) == 2) {
            in_path = strstr(line, path) != NULL; /* a mapping's first line: "start-end perms ... path" */
        } else if (in_path && sscanf(line, "Rss: %ld kB", &kib) == 1) {
            total += kib;
        }
    }
    CHECK_EQ(fclose(smaps), 0);
    return total;
}

/* Whether the page cache holds every page of [offset, offset + length) of fd (whole pages). */
static int all_cached(int fd, uint64_t offset, uint64_t length) {
    unsigned char resident[1024];
    CHECK(length / 4096 <= sizeof(resident) && offset % 4096 == 0);
    void *map = mmap(NULL, (size_t)length, PROT_READ, MAP_SHARED, fd, (off_t)offset);
    CHECK(map != MAP_FAILED);
    CHECK_EQ(mincore(map, (size_t)length, resident), 0);
    CHECK_EQ(munmap(map, (size_t)length), 0);
    for (uint64_t page = 0; page < length / 4096; page++) {
        if ((resident[page] & 1) == 0) {
            return 0;
        }
    }
    return 1;
}

/* The page fill for a test, or -1 where the kernel refuses it (test_page_fill says why). */
static int32_t open_page_fill(void) {
    int32_t fill_fd = -1;
    int32_t sys_errno = 0;
    return se_fill_open(&fill_fd, &sys_errno) == SE_OK ? fill_fd : -1;
}

/* O_DIRECT page-fill blocks longer than SE_FILL_DIRECT_CHUNK are read a chunk at a time into the
 * reader's huge-page buffer: every byte lands, across chunk and block edges, up to a last page cut
 * short by the end of the file. */
static void test_page_fill_of_o_direct_blocks_past_a_chunk(void) {
    int32_t sys_errno = 0;
    const int32_t fill_fd = open_page_fill();
    if (fill_fd < 0) {
        return; /* test_page_fill says why */
    }
    const uint64_t size = 2 * SE_FILL_DIRECT_CHUNK + MIB + 777;
    const uint64_t mapped = (size + 4095) / 4096 * 4096;
    const se_unit units[2] = {{0, 0, SE_FILL_DIRECT_CHUNK + 5, 0}, {0, SE_FILL_DIRECT_CHUNK + 5, size, 0}};
    unsigned char *data = random_bytes(size, 29);
    temp_file f;
    temp_create(&f, data, size);
    unsigned char *dst = se_alloc(mapped, 0);
    CHECK(dst != NULL);
    CHECK_EQ(se_fill_register(fill_fd, dst, mapped, &sys_errno), SE_OK);
    se_block blocks[8];
    size_t n = fill_blocks(units, 2, size, SE_FILL_DIRECT_CHUNK + 3 * MIB, dst, blocks);
    se_engine *e = engine_new(2, units, 2);
    CHECK_EQ(engine_add(e, f.path, 1, NULL), 0);
    CHECK_EQ(se_engine_set_fill(e, fill_fd, 4 * MIB), SE_OK);
    CHECK_EQ(se_engine_submit(e, blocks, n), SE_OK);
    uint8_t seen[2] = {0, 0};
    collect(e, seen, 2, 2, 2);
    wait_blocks_done(e, n);
    se_stats stats;
    se_engine_stats(e, &stats);
    CHECK_EQ(stats.bytes_filled, mapped);
    se_engine_destroy(e);
    CHECK_EQ(se_fill_unregister(fill_fd, dst, mapped, &sys_errno), SE_OK);
    CHECK(memcmp(dst, data, size) == 0);
    for (uint64_t i = size; i < mapped; i++) {
        CHECK_EQ(dst[i], 0);
    }
    se_free(dst, mapped, 0);
    temp_remove(&f);
    se_fill_close(fill_fd);
    free(data);
}

/* One reader fills from a buffered file whose page cache lost its middle (read into the reader's
 * buffer for reads through the cache) and from an O_DIRECT file (its buffer for O_DIRECT reads),
 * in turn: every byte lands in both, and the reader frees both buffers. */
static void test_page_fill_of_a_buffered_and_an_o_direct_file_on_one_reader(void) {
    int32_t sys_errno = 0;
    const int32_t fill_fd = open_page_fill();
    if (fill_fd < 0) {
        return; /* test_page_fill says why */
    }
    const uint64_t size = 3 * MIB;
    const se_unit units[2] = {{0, 0, size, 0}, {1, 0, size, 0}};
    unsigned char *data[2] = {random_bytes(size, 41), random_bytes(size, 43)};
    temp_file f[2];
    unsigned char *dst[2];
    for (int i = 0; i < 2; i++) {
        temp_create(&f[i], data[i], size);
        dst[i] = se_alloc(size, 0);
        CHECK(dst[i] != NULL);
        CHECK_EQ(se_fill_register(fill_fd, dst[i], size, &sys_errno), SE_OK);
    }
    CHECK_EQ(fdatasync(f[0].fd), 0);
    CHECK_EQ(posix_fadvise(f[0].fd, MIB, MIB, POSIX_FADV_DONTNEED), 0);
    int cached = all_cached(f[0].fd, MIB, MIB); /* a tmpfs keeps its pages */
    se_engine *e = engine_new(1, units, 2);
    CHECK_EQ(engine_add(e, f[0].path, 0, NULL), 0);
    int32_t is_direct = 0;
    CHECK_EQ(engine_add(e, f[1].path, 1, &is_direct), 1);
    CHECK_EQ(se_engine_set_fill(e, fill_fd, 4 * MIB), SE_OK);
    se_block blocks[4];
    for (int i = 0; i < 4; i++) {
        const int32_t file = i % 2;
        const uint64_t offset = i < 2 ? 0 : 2 * MIB;
        const uint64_t length = i < 2 ? 2 * MIB : MIB;
        blocks[i] = (se_block){file, (uint32_t)file, (uint32_t)file, SE_BLOCK_FILL, offset,
                               offset + length, offset, length, dst[file] + offset};
    }
    CHECK_EQ(se_engine_submit(e, blocks, 4), SE_OK);
    uint8_t seen[2] = {0, 0};
    collect(e, seen, 2, 2, 2);
    wait_blocks_done(e, 4);
    se_stats stats;
    se_engine_stats(e, &stats);
    CHECK_EQ(stats.bytes_filled, 2 * size);
    CHECK_EQ(stats.bytes_mapped, (cached ? size : size - MIB) + (is_direct ? 0 : size));
    se_engine_destroy(e);
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(se_fill_unregister(fill_fd, dst[i], size, &sys_errno), SE_OK);
        CHECK(memcmp(dst[i], data[i], size) == 0);
        se_free(dst[i], size, 0);
        temp_remove(&f[i]);
        free(data[i]);
    }
    se_fill_close(fill_fd);
}

/* A file cut short after it was mapped: the pages its mapping still shows hold zeros past the new
 * end, and those past it cannot be copied. Either way the chunk is read, and the block is
 * truncated, never filled with zeros that the file no longer holds. */
static void test_page_fill_of_a_file_cut_after_mapping(void) {
    int32_t sys_errno = 0;
    const int32_t fill_fd = open_page_fill();
    if (fill_fd < 0) {
        return; /* test_page_fill says why */
    }
    const uint64_t size = 3 * MIB;
    const uint64_t cuts[2] = {2 * MIB + 1, MIB + 100};
    const se_unit units[1] = {{0, 5000, 2 * MIB + 3, 0}};
    unsigned char *data = random_bytes(size, 23);
    for (int i = 0; i < 2; i++) {
        temp_file f;
        temp_create(&f, data, size);
        unsigned char *dst = se_alloc(4 * MIB, 0);
        CHECK(dst != NULL);
        CHECK_EQ(se_fill_register(fill_fd, dst, 4 * MIB, &sys_errno), SE_OK);
        se_engine *e = engine_new(2, units, 1);
        CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
        CHECK_EQ(se_engine_set_fill(e, fill_fd, 4 * MIB), SE_OK);
        CHECK_EQ(ftruncate(f.fd, (off_t)cuts[i]), 0);
        se_block block = {0, 0, 0, SE_BLOCK_FILL, 5000, 2 * MIB + 3, 4096, 2 * MIB, dst + 4096};
        CHECK_EQ(se_engine_submit(e, &block, 1), SE_OK);
        CHECK_EQ(wait_for_error(e), SE_ERR_TRUNCATED);
        se_engine_destroy(e);
        CHECK_EQ(se_fill_unregister(fill_fd, dst, 4 * MIB, &sys_errno), SE_OK);
        se_free(dst, 4 * MIB, 0);
        temp_remove(&f);
    }
    se_fill_close(fill_fd);
    free(data);
}

/* The page fill: fresh pages placed holding their bytes, buffered and O_DIRECT, a page that
 * exists already written plainly, the tail after EOF zero; the blocks it refuses; a kernel read
 * into an unfilled page fails (EFAULT) instead of waiting. */
static void test_page_fill(void) {
    int32_t fill_fd = -1;
    int32_t sys_errno = -1;
    if (se_fill_open(&fill_fd, &sys_errno) != SE_OK) {
        CHECK(sys_errno != 0 && fill_fd == -1);
        printf("note: this kernel refuses a page fill (errno %d); only that was tested\n", sys_errno);
        return;
    }
    const uint64_t size = 3 * MIB + 1234;
    const uint64_t mapped = 4 * MIB;
    unsigned char *data = random_bytes(size, 21);
    temp_file f;
    temp_create(&f, data, size);
    const se_unit units[3] = {{0, 10, 5000, 0}, {0, 5000, 2 * MIB + 3, 0}, {0, 2 * MIB + 3, size, 0}};
    se_block blocks[64];

    /* Buffered with the file's pages unmapped after every chunk and only at each block's end (a
     * view larger than any block), then O_DIRECT. */
    const uint64_t views[3] = {0, 8 * MIB, 0};
    for (int variant = 0; variant < 3; variant++) {
        const int direct = variant == 2;
        unsigned char *dst = se_alloc(mapped, 0);
        CHECK(dst != NULL);
        dst[MIB + 8192] = 7; /* a page that exists before the fill */
        CHECK_EQ(se_fill_register(fill_fd, dst, mapped, &sys_errno), SE_OK);
        size_t n = fill_blocks(units, 3, size, 256 * KIB, dst, blocks);
        se_engine *e = engine_new(3, units, 3);
        int32_t is_direct = 0;
        CHECK_EQ(engine_add(e, f.path, direct, &is_direct), 0);
        CHECK_EQ(se_engine_submit(e, blocks, 1), SE_ERR_INVALID); /* no page fill lent yet */
        CHECK_EQ(se_engine_set_fill(e, -1, 0), SE_ERR_INVALID);
        CHECK(!is_mapped(f.path)); /* an engine without a page fill maps nothing */
        CHECK_EQ(se_engine_set_fill(e, fill_fd, views[variant]), SE_OK);
        CHECK_EQ(is_mapped(f.path), !is_direct);
        se_block bad = blocks[0];
        bad.read_length -= 512; /* not whole pages */
        CHECK_EQ(se_engine_submit(e, &bad, 1), SE_ERR_INVALID);
        bad = blocks[0];
        bad.flags = 2; /* unknown */
        CHECK_EQ(se_engine_submit(e, &bad, 1), SE_ERR_INVALID);
        CHECK_EQ(se_engine_submit(e, blocks, n), SE_OK);
        uint8_t seen[3] = {0, 0, 0};
        collect(e, seen, 3, 3, 3);
        wait_blocks_done(e, n);
        se_stats stats;
        se_engine_stats(e, &stats);
        CHECK_EQ(stats.bytes_filled, (size + 4095) / 4096 * 4096);
        /* A buffered file just written is in the page cache: its whole pages come from its
         * mapping, the last page (cut short by the end of the file) from a read. */
        CHECK_EQ(stats.bytes_mapped, is_direct ? 0 : size / 4096 * 4096);
        CHECK_EQ(mapped_rss_kib(f.path), 0); /* every block's pages unmapped at its end */
        se_engine_destroy(e);
        CHECK(!is_mapped(f.path));
        CHECK_EQ(se_fill_unregister(fill_fd, dst, mapped, &sys_errno), SE_OK);
        CHECK(memcmp(dst, data, size) == 0);
        for (uint64_t i = size; i < mapped; i++) {
            CHECK_EQ(dst[i], 0); /* the last page's tail, and pages never filled */
        }
        se_free(dst, mapped, 0);
    }

    /* A plain read into a registered page nobody filled fails: the kernel does not wait. */
    unsigned char *dst = se_alloc(mapped, 0);
    CHECK(dst != NULL);
    CHECK_EQ(se_fill_register(fill_fd, dst, mapped, &sys_errno), SE_OK);
    se_engine *e = engine_new(1, units, 3);
    CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
    CHECK_EQ(se_engine_set_fill(e, fill_fd, 4 * MIB), SE_OK);
    const se_block plain = plain_block(0, 0, 0, 10, 5000, dst);
    CHECK_EQ(se_engine_submit(e, &plain, 1), SE_OK);
    CHECK_EQ(wait_for_error(e), SE_ERR_READ);
    se_error_info err;
    se_engine_error(e, &err);
    CHECK_EQ(err.sys_errno, EFAULT);
    se_engine_destroy(e);

    /* A page-fill block past the end of the file: truncated, like any read. */
    e = engine_new(1, units, 3);
    CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
    CHECK_EQ(se_engine_set_fill(e, fill_fd, 4 * MIB), SE_OK);
    se_block past = {0, 2, 2, SE_BLOCK_FILL, 3 * MIB, size + 5000, 3 * MIB, MIB, dst + 3 * MIB};
    CHECK_EQ(se_engine_submit(e, &past, 1), SE_OK);
    CHECK_EQ(wait_for_error(e), SE_ERR_TRUNCATED);
    se_engine_destroy(e);

    /* Pages the cache does not hold are read, not faulted in through the mapping. */
    e = engine_new(1, units, 3);
    CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
    CHECK_EQ(fdatasync(f.fd), 0);
    CHECK_EQ(posix_fadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    int cached = all_cached(f.fd, MIB, MIB); /* a tmpfs keeps its pages */
    CHECK_EQ(se_engine_set_fill(e, fill_fd, 4 * MIB), SE_OK);
    se_block middle = {0, 1, 1, SE_BLOCK_FILL, MIB, 2 * MIB, MIB, MIB, dst + MIB};
    CHECK_EQ(se_engine_submit(e, &middle, 1), SE_OK);
    wait_blocks_done(e, 1);
    se_stats stats;
    se_engine_stats(e, &stats);
    CHECK_EQ(stats.bytes_filled, MIB);
    CHECK_EQ(stats.bytes_mapped, cached ? MIB : 0);
    se_engine_destroy(e);
    CHECK(memcmp(dst + MIB, data + MIB, MIB) == 0);

    se_fill_close(fill_fd); /* unregisters what is left: the memory is plain again */
    CHECK(memcmp(dst + 3 * MIB, data + 3 * MIB, size - 3 * MIB) == 0);
    CHECK_EQ(dst[0], 0);
    se_free(dst, mapped, 0);

    CHECK_EQ(se_fill_register(-1, dst, mapped, &sys_errno), SE_ERR_INVALID);
    CHECK_EQ(se_fill_register(0, dst + 1, mapped, &sys_errno), SE_ERR_INVALID);
    CHECK_EQ(sys_errno, EINVAL);
    se_fill_close(-1);
    temp_remove(&f);
    free(data);
}

/* se_populate never changes a byte, even while another thread writes the same range. */
static void test_populate_beside_writer(void) {
    int32_t err = -1;
    CHECK_EQ(se_populate(NULL, 0, &err), SE_OK);
    CHECK_EQ(err, 0);
    const size_t size = 16 * MIB + 4096;
    for (int32_t huge = 0; huge <= 1; huge++) {
        unsigned char *p = se_alloc(size, huge);
        CHECK(p != NULL);
        pattern_writer w = {p, size};
        pthread_t writer;
        CHECK_EQ(pthread_create(&writer, NULL, write_pattern_backwards, &w), 0);
        for (size_t at = 0; at < size; at += MIB) {
            int32_t status = se_populate(p + at, size - at < MIB ? size - at : MIB, &err);
            CHECK(status == SE_OK || (status == SE_ERR_INVALID && err == EINVAL)); /* EINVAL: old kernel */
        }
        CHECK_EQ(pthread_join(writer, NULL), 0);
        int32_t whole = se_populate(p, size, &err);
        CHECK(whole == SE_OK || err == EINVAL);
        if (whole == SE_OK) { /* a kernel that can: any start, not only a page-aligned one */
            CHECK_EQ(se_populate(p + 4097, size - 4097, &err), SE_OK);
        }
        for (size_t i = 0; i < size; i++) {
            CHECK(p[i] == (unsigned char)(i * 13 + 1));
        }
        se_free(p, size, huge);
    }
}

static void test_sampled_residency(void) {
    const uint64_t size = 8 * MIB;
    unsigned char *data = random_bytes(size, 12);
    temp_file f;
    temp_create(&f, data, size);
    CHECK(fdatasync(f.fd) == 0);
    CHECK(posix_fadvise(f.fd, (off_t)(size / 2), (off_t)(size / 2), POSIX_FADV_DONTNEED) == 0);
    uint64_t exact = 0;
    uint64_t sampled = 0;
    uint64_t total = 0;
    int32_t sys_errno = -1;
    CHECK_EQ(se_resident_bytes(f.path, 0, UINT64_MAX, 1, &exact, &total, &sys_errno), SE_OK);
    CHECK_EQ(se_resident_bytes(f.path, 0, UINT64_MAX, 2, &sampled, &total, &sys_errno), SE_OK);
    CHECK_EQ(total, size);
    CHECK_EQ(sampled, exact);
    CHECK_EQ(se_resident_bytes(f.path, 0, UINT64_MAX, 1000, &sampled, &total, &sys_errno), SE_OK);
    CHECK(sampled == 0 || sampled == size); /* one window, the first, stands for the file */
    temp_remove(&f);
    free(data);
}

/* 9c. A range counts only its own bytes, to the byte where pages are cut; it is clipped to the
 * file. The second half of an 8 MiB file is evicted where the filesystem lets it be. */
static void test_ranged_residency(void) {
    const uint64_t size = 8 * MIB;
    const uint64_t half = size / 2;
    unsigned char *data = random_bytes(size, 13);
    temp_file f;
    temp_create(&f, data, size);
    CHECK(fdatasync(f.fd) == 0);
    CHECK(posix_fadvise(f.fd, (off_t)half, (off_t)half, POSIX_FADV_DONTNEED) == 0);
    uint64_t whole = 0;
    uint64_t head = 0;
    uint64_t tail = 0;
    uint64_t total = 0;
    int32_t sys_errno = -1;
    CHECK_EQ(se_resident_bytes(f.path, 0, UINT64_MAX, 1, &whole, &total, &sys_errno), SE_OK);
    CHECK(whole == half || whole == size); /* evicted, or a filesystem that keeps it (tmpfs) */
    CHECK_EQ(se_resident_bytes(f.path, 0, half, 1, &head, &total, &sys_errno), SE_OK);
    CHECK_EQ(total, half);
    CHECK_EQ(head, half);
    CHECK_EQ(se_resident_bytes(f.path, half, UINT64_MAX, 1, &tail, &total, &sys_errno), SE_OK);
    CHECK_EQ(total, half);
    CHECK_EQ(head + tail, whole);

    uint64_t straddle = 0;
    CHECK_EQ(se_resident_bytes(f.path, half - 100, 300, 1, &straddle, &total, &sys_errno), SE_OK);
    CHECK_EQ(total, 300);
    CHECK_EQ(straddle, whole == half ? 100 : 300);
    CHECK_EQ(se_resident_bytes(f.path, 4097, 10, 1, &straddle, &total, &sys_errno), SE_OK);
    CHECK_EQ(total, 10);
    CHECK_EQ(straddle, 10);

    CHECK_EQ(se_resident_bytes(f.path, size - 5, 100, 1, &straddle, &total, &sys_errno), SE_OK);
    CHECK_EQ(total, 5); /* clipped to the file */
    straddle = 1;
    CHECK_EQ(se_resident_bytes(f.path, size + 5, 100, 1, &straddle, &total, &sys_errno), SE_OK);
    CHECK_EQ(total, 0);
    CHECK_EQ(straddle, 0);
    temp_remove(&f);
    free(data);
}

/* 10. Stats count every byte pread returned and every block read. */
static void test_stats(void) {
    const uint64_t size = MIB + 7;
    unsigned char *data = random_bytes(size, 11);
    temp_file f;
    temp_create(&f, data, size);
    unsigned char *dst = malloc(size);
    CHECK(dst != NULL);
    const se_unit units[3] = {{0, 0, 1000, 0}, {0, 1000, 700000, 0}, {0, 700000, size, 0}};
    se_block blocks[32];

    se_engine *e = engine_new(3, units, 3);
    CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
    se_stats stats;
    se_engine_stats(e, &stats);
    CHECK_EQ(stats.bytes_read, 0);
    CHECK_EQ(stats.blocks_done, 0);

    size_t n_blocks = plan_blocks(units, 0, 3, size, 40000, 0, dst, blocks);
    CHECK(n_blocks <= 32);
    uint64_t bytes = 0;
    for (size_t i = 0; i < n_blocks; i++) {
        bytes += blocks[i].read_length;
    }
    CHECK_EQ(bytes, size);
    CHECK_EQ(se_engine_submit(e, blocks, n_blocks), SE_OK);
    uint8_t seen[3] = {0, 0, 0};
    collect(e, seen, 3, 3, 3);
    wait_blocks_done(e, n_blocks);
    se_engine_stats(e, &stats);
    CHECK(stats.bytes_read >= bytes);
    CHECK_EQ(stats.blocks_done, n_blocks);
    CHECK(stats.read_seconds >= 0.0);
    CHECK(stats.idle_seconds >= 0.0);
    se_engine_destroy(e);
    CHECK(memcmp(dst, data, size) == 0);

    free(dst);
    temp_remove(&f);
    free(data);
}

/* 11. Stress: create, submit, wait for all, destroy, 50 times with 8 workers. */
static void test_stress(void) {
    const uint64_t size = 256 * KIB;
    const uint32_t n_units = 64;
    unsigned char *data = random_bytes(size, 12);
    temp_file f;
    temp_create(&f, data, size);
    unsigned char *dst = malloc(size);
    se_unit *units = malloc(n_units * sizeof(*units));
    se_block *blocks = malloc((size / 3000 + 2) * sizeof(*blocks));
    CHECK(dst != NULL && units != NULL && blocks != NULL);
    for (uint32_t u = 0; u < n_units; u++) {
        se_unit unit = {0, u * (size / n_units), (u + 1) * (size / n_units), 0};
        units[u] = unit;
    }
    size_t n_blocks = plan_blocks(units, 0, n_units, size, 3000, 0, dst, blocks);
    CHECK(n_blocks <= size / 3000 + 2);

    for (int iteration = 0; iteration < 50; iteration++) {
        memset(dst, 0, size);
        se_engine *e = engine_new(8, units, n_units);
        CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
        size_t half = n_blocks / 2;
        CHECK_EQ(se_engine_submit(e, blocks, half), SE_OK);
        CHECK_EQ(se_engine_submit(e, blocks + half, n_blocks - half), SE_OK);
        uint8_t seen[64] = {0};
        collect(e, seen, n_units, n_units, 1 + (size_t)iteration % 16);
        se_engine_destroy(e);
        CHECK(memcmp(dst, data, size) == 0);
    }

    free(blocks);
    free(units);
    free(dst);
    temp_remove(&f);
    free(data);
}

/*
 * 12. Files added while workers read earlier files: the header lets the
 * controlling thread call any function while the workers run. The first 8
 * files' blocks are queued before the rest are added, so a growing file
 * table (if the engine has one) very likely moves while reads are in flight.
 */
static void test_add_files_while_reading(void) {
    enum { N_FILES = 260, FIRST = 8 }; /* tables of 8, 16, ... 256 entries all fill up */
    const uint64_t size = 256 * KIB;
    const uint64_t block = 32 * KIB;
    const uint32_t per_file = (uint32_t)(size / block);
    const uint32_t n_units = N_FILES * per_file;
    unsigned char *data = random_bytes(size, 13);
    temp_file f;
    temp_create(&f, data, size);
    unsigned char *dst = malloc(N_FILES * size);
    se_unit *units = malloc(n_units * sizeof(*units));
    se_block *blocks = malloc(n_units * sizeof(*blocks));
    uint8_t *seen = calloc(n_units, 1);
    CHECK(dst != NULL && units != NULL && blocks != NULL && seen != NULL);
    for (uint32_t u = 0; u < n_units; u++) {
        int32_t file = (int32_t)(u / per_file);
        uint64_t begin = (u % per_file) * block;
        se_unit unit = {file, begin, begin + block, 0};
        units[u] = unit;
        blocks[u] = plain_block(file, u, u, begin, begin + block, dst + (uint64_t)file * size);
    }

    se_engine *e = engine_new(4, units, n_units);
    for (int32_t file = 0; file < FIRST; file++) {
        CHECK_EQ(engine_add(e, f.path, 0, NULL), file);
    }
    CHECK_EQ(se_engine_submit(e, blocks, (size_t)FIRST * per_file), SE_OK);
    sleep_ms(1); /* let the workers start reading */
    for (int32_t file = FIRST; file < N_FILES; file++) {
        CHECK_EQ(engine_add(e, f.path, 0, NULL), file);
        CHECK_EQ(se_engine_submit(e, blocks + (size_t)file * per_file, per_file), SE_OK);
    }
    collect(e, seen, n_units, n_units, 64);
    se_engine_destroy(e);
    for (int file = 0; file < N_FILES; file++) {
        CHECK(memcmp(dst + (uint64_t)file * size, data, size) == 0);
    }

    free(seen);
    free(blocks);
    free(units);
    free(dst);
    temp_remove(&f);
    free(data);
}

typedef struct crediter {
    se_engine *engine;
    const se_block *blocks;
    size_t n_blocks;
} crediter;

/* An external reader: "reads" each block (a memcpy) and credits it from its own thread. */
static void *crediter_main(void *arg) {
    crediter *c = arg;
    for (size_t i = 0; i < c->n_blocks; i++) {
        CHECK_EQ(se_engine_credit(c->engine, &c->blocks[i]), SE_OK);
    }
    return NULL;
}

/*
 * 13. External files: credited blocks complete units exactly like worker reads (units of a
 * local and an external file in one run), submit and credit refuse each other's files, a
 * failure reported with se_engine_fail wakes waiters with its info and stops crediting.
 */
static void test_external_files(void) {
    const uint64_t size = 2 * MIB;
    const uint64_t block = 64 * KIB;
    unsigned char *data = random_bytes(size, 13);
    temp_file f;
    temp_create(&f, data, size);
    unsigned char *dst_local = calloc(1, size);
    unsigned char *dst_ext = calloc(1, size);
    uint64_t rng = 1313;
    se_unit units[256];
    uint32_t n_local = make_units(units, 128, 0, size, &rng);
    uint32_t n_ext = make_units(units + n_local, 128, 1, size, &rng);
    uint32_t n_units = n_local + n_ext;
    se_block *local_blocks = malloc(4096 * sizeof(*local_blocks));
    se_block *ext_blocks = malloc(4096 * sizeof(*ext_blocks));
    CHECK(dst_local != NULL && dst_ext != NULL && local_blocks != NULL && ext_blocks != NULL);
    size_t n_lb = plan_blocks(units, 0, n_local, size, block, 1, dst_local, local_blocks);
    size_t n_eb = plan_blocks(units, n_local, n_units, size, block, 0, dst_ext, ext_blocks);
    for (size_t i = 0; i < n_eb; i++) {
        memcpy(ext_blocks[i].dst, data + ext_blocks[i].read_offset,
               (size_t)min_u64(ext_blocks[i].read_length, size - ext_blocks[i].read_offset));
    }
    shuffle_blocks(ext_blocks, n_eb, &rng);

    se_engine *e = engine_new(2, units, n_units);
    CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
    CHECK_EQ(se_engine_add_external_file(e), 1);
    /* Each side refuses the other's blocks. */
    CHECK_EQ(se_engine_submit(e, ext_blocks, 1), SE_ERR_INVALID);
    CHECK_EQ(se_engine_credit(e, &local_blocks[0]), SE_ERR_INVALID);
    se_block bad = ext_blocks[0];
    bad.last_unit = n_units;
    CHECK_EQ(se_engine_credit(e, &bad), SE_ERR_INVALID);
    bad = ext_blocks[0];
    bad.file = 2;
    CHECK_EQ(se_engine_credit(e, &bad), SE_ERR_INVALID);
    bad = ext_blocks[0];
    bad.flags = SE_BLOCK_FILL; /* an external reader writes its own bytes: never through the fill */
    CHECK_EQ(se_engine_credit(e, &bad), SE_ERR_INVALID);
    se_error_info ok_info = {SE_OK, 0, 1, 0, 0, 0};
    CHECK_EQ(se_engine_fail(e, &ok_info), SE_ERR_INVALID);
    CHECK_EQ(se_engine_fail(e, NULL), SE_ERR_INVALID);

    CHECK_EQ(se_engine_submit(e, local_blocks, n_lb), SE_OK);
    crediter c = {e, ext_blocks, n_eb};
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, crediter_main, &c) == 0);
    uint8_t seen[256] = {0};
    collect(e, seen, n_units, n_units, 7);
    CHECK(pthread_join(thread, NULL) == 0);
    expect_quiet(e, 20);
    for (uint32_t u = 0; u < n_units; u++) {
        const unsigned char *dst = units[u].file == 0 ? dst_local : dst_ext;
        CHECK(memcmp(dst + units[u].begin, data + units[u].begin, units[u].end - units[u].begin) == 0);
    }
    se_stats stats;
    se_engine_stats(e, &stats);
    CHECK_EQ(stats.blocks_done, n_lb + n_eb);
    se_engine_destroy(e);

    /* A failure from the external reader: waiters wake with it, the first one sticks. */
    e = engine_new(1, units, n_units);
    CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
    CHECK_EQ(se_engine_add_external_file(e), 1);
    waiter w = {e, 12345, 0.0};
    CHECK(pthread_create(&thread, NULL, waiter_main, &w) == 0);
    sleep_ms(50);
    se_error_info info = {SE_ERR_EXTERNAL, 0, 1, 4096, 100, 7};
    CHECK_EQ(se_engine_fail(e, &info), SE_OK);
    se_error_info later = {SE_ERR_READ, 5, 0, 0, 1, 0};
    CHECK_EQ(se_engine_fail(e, &later), SE_OK);
    CHECK(pthread_join(thread, NULL) == 0);
    CHECK_EQ(w.rc, SE_ERR_EXTERNAL);
    CHECK(w.seconds < 10.0);
    se_error_info err;
    se_engine_error(e, &err);
    CHECK_EQ(err.code, SE_ERR_EXTERNAL);
    CHECK_EQ(err.file, 1);
    CHECK_EQ(err.offset, 4096);
    CHECK_EQ(err.expected, 100);
    CHECK_EQ(err.got, 7);
    CHECK_EQ(se_engine_credit(e, &ext_blocks[0]), SE_ERR_EXTERNAL);
    CHECK_EQ(se_engine_submit(e, local_blocks, 1), SE_ERR_EXTERNAL);
    se_engine_destroy(e);

    /* After cancel, credits are refused and nothing completes. */
    e = engine_new(1, units, n_units);
    CHECK_EQ(engine_add(e, f.path, 0, NULL), 0);
    CHECK_EQ(se_engine_add_external_file(e), 1);
    se_engine_cancel(e);
    CHECK_EQ(se_engine_credit(e, &ext_blocks[0]), SE_ERR_CANCELLED);
    se_engine_destroy(e);

    free(ext_blocks);
    free(local_blocks);
    free(dst_ext);
    free(dst_local);
    temp_remove(&f);
    free(data);
}

/* ---------------------------------------------------------------- pieces */

/* A team runner with GOMP_parallel's signature, on plain pthreads: n_threads - 1 of them and the
 * caller, each member counted in g_team_members. */
static void *fake_member(void *arg) {
    void **call = arg;
    ((void (*)(void *))call[0])(call[1]);
    return NULL;
}

static void fake_team(void (*work)(void *), void *arg, unsigned int n_threads, unsigned int flags) {
    CHECK_EQ(flags, 0);
    void *call[2] = {(void *)work, arg};
    pthread_t members[8];
    CHECK(n_threads >= 1 && n_threads <= 9);
    for (unsigned int i = 0; i + 1 < n_threads; i++) {
        CHECK(pthread_create(&members[i], NULL, fake_member, call) == 0);
    }
    work(arg);
    atomic_fetch_add(&g_team_members, (int)n_threads);
    for (unsigned int i = 0; i + 1 < n_threads; i++) {
        CHECK(pthread_join(members[i], NULL) == 0);
    }
}

/* Pieces of several files, buffers of every size (empty ones, more than one preadv takes), read
 * on one thread, on threads of its own and on a team: every byte lands where it belongs. */
static void test_read_pieces(void) {
    const uint64_t size = 3 * MIB + 333;
    unsigned char *data = random_bytes(size, 21);
    temp_file a, b;
    temp_create(&a, data, size);
    temp_create(&b, data + 1000, size - 1000);
    enum { N_BUFFERS = 300 };
    se_buffer buffers[N_BUFFERS];
    uint64_t lengths[N_BUFFERS];
    uint64_t total = 0;
    for (int i = 0; i < N_BUFFERS; i++) {
        lengths[i] = i % 7 == 3 ? 0 : (uint64_t)(i * 977 % 20011) + 1;
        total += lengths[i];
    }
    CHECK(total < size - 1000);
    unsigned char *dst = malloc(total);
    CHECK(dst != NULL);
    /* pieces: buffers 0-149 (file a from 17), 150-229 (file b from 0), 230-299 (file a after) */
    uint64_t at = 0;
    for (int i = 0; i < N_BUFFERS; i++) {
        buffers[i].address = (uintptr_t)(dst + at);
        buffers[i].length = lengths[i];
        at += lengths[i];
    }
    uint64_t first_bytes = 0, second_bytes = 0;
    for (int i = 0; i < 150; i++) first_bytes += lengths[i];
    for (int i = 150; i < 230; i++) second_bytes += lengths[i];
    const se_piece pieces[3] = {
        {17, a.fd, 0, 150},
        {0, b.fd, 150, 80},
        {17 + first_bytes, a.fd, 230, 70},
    };
    const uint32_t threads[4] = {1, 3, 2, 4};
    for (int c = 0; c < 4; c++) {
        memset(dst, 0xAB, total);
        atomic_store(&g_team_members, 0);
        se_error_info err;
        se_team_fn team = c >= 2 ? fake_team : NULL;
        CHECK_EQ(se_read_pieces(pieces, 3, buffers, N_BUFFERS, threads[c], team, &err), SE_OK);
        CHECK_EQ(err.code, SE_OK);
        CHECK_EQ(err.file, -1);
        CHECK(memcmp(dst, data + 17, first_bytes) == 0);
        CHECK(memcmp(dst + first_bytes, data + 1000, second_bytes) == 0);
        CHECK(memcmp(dst + first_bytes + second_bytes, data + 17 + first_bytes,
                     total - first_bytes - second_bytes) == 0);
        CHECK_EQ(atomic_load(&g_team_members), team != NULL ? (int)min_u64(threads[c], 3) : 0);
    }
    free(dst);
    temp_remove(&b);
    temp_remove(&a);
    free(data);
}

/* A piece running past the end of its file, an unreadable descriptor, pieces outside the buffer
 * table: typed failures naming the piece, the others' bytes untouched after the stop. */
static void test_read_pieces_failures(void) {
    const uint64_t size = 10000;
    unsigned char *data = random_bytes(size, 22);
    temp_file f;
    temp_create(&f, data, size);
    unsigned char dst[3 * 4096];
    const se_buffer buffers[3] = {
        {(uintptr_t)dst, 4096}, {(uintptr_t)(dst + 4096), 4096}, {(uintptr_t)(dst + 8192), 4096}};
    se_error_info err;

    const se_piece past_end[2] = {{0, f.fd, 0, 1}, {8000, f.fd, 1, 1}};
    for (uint32_t threads = 1; threads <= 2; threads++) {
        CHECK_EQ(se_read_pieces(past_end, 2, buffers, 3, threads, threads == 2 ? fake_team : NULL, &err),
                 SE_ERR_TRUNCATED);
        CHECK_EQ(err.code, SE_ERR_TRUNCATED);
        CHECK_EQ(err.sys_errno, 0);
        CHECK_EQ(err.file, 1);
        CHECK_EQ(err.offset, size);
        CHECK_EQ(err.expected, 4096);
        CHECK_EQ(err.got, size - 8000);
        CHECK(memcmp(dst + 4096, data + 8000, size - 8000) == 0);
    }

    const se_piece closed[1] = {{0, -1, 0, 2}};
    CHECK_EQ(se_read_pieces(closed, 1, buffers, 3, 1, NULL, &err), SE_ERR_READ);
    CHECK_EQ(err.sys_errno, EBADF);
    CHECK_EQ(err.file, 0);
    CHECK_EQ(err.got, 0);
    CHECK_EQ(err.expected, 8192);

    const se_piece outside[2] = {{0, f.fd, 0, 1}, {0, f.fd, 2, 2}};
    CHECK_EQ(se_read_pieces(outside, 2, buffers, 3, 1, NULL, &err), SE_ERR_INVALID);
    const se_piece wrapping[1] = {{0, f.fd, 1, UINT32_MAX}};
    CHECK_EQ(se_read_pieces(wrapping, 1, buffers, 3, 1, NULL, &err), SE_ERR_INVALID);
    CHECK_EQ(se_read_pieces(NULL, 0, NULL, 0, 4, NULL, &err), SE_OK);
    temp_remove(&f);
    free(data);
}

static void test_crc32c(void) {
    /* The check value of CRC-32C (RFC 3720's "123456789"), and an empty input. */
    CHECK_EQ(se_crc32c(0, "123456789", 9), 0xE3069283u);
    CHECK_EQ(se_crc32c(0, "", 0), 0u);
    const size_t n = 1000003;
    uint8_t *data = malloc(n);
    CHECK(data != NULL);
    for (size_t i = 0; i < n; i++) {
        data[i] = (uint8_t)(i * 131u + (i >> 9));
    }
    uint32_t whole = se_crc32c(0, data, n);
    /* Continuing, and combining pieces, at every kind of split (unaligned, empty, whole). */
    const size_t splits[] = {0, 1, 7, 8, 9, 4096, 65535, n / 2, n - 1, n};
    for (size_t s = 0; s < sizeof splits / sizeof splits[0]; s++) {
        size_t at = splits[s];
        uint32_t head = se_crc32c(0, data, at);
        uint32_t tail = se_crc32c(0, data + at, n - at);
        CHECK_EQ(se_crc32c(head, data + at, n - at), whole);
        CHECK_EQ(se_crc32c_combine(head, tail, n - at), whole);
    }
    /* Misaligned starts take the same path as aligned ones. */
    CHECK_EQ(se_crc32c(se_crc32c(0, data, 3), data + 3, 10), se_crc32c(0, data, 13));
    free(data);
}

int main(void) {
    RUN(test_read_many_units);
    RUN(test_straddling_blocks);
    RUN(test_sparse_unit);
    RUN(test_buffered_reads_credited_only);
    RUN(test_direct_file_reads_unaligned_blocks_buffered);
    RUN(test_direct_io);
    RUN(test_truncated_file);
    RUN(test_file_shrinks_between_batches);
    RUN(test_invalid_arguments);
    RUN(test_cancel);
    RUN(test_create_destroy);
    RUN(test_memory_and_residency);
    RUN(test_populate_beside_writer);
    RUN(test_page_fill);
    RUN(test_page_fill_of_o_direct_blocks_past_a_chunk);
    RUN(test_page_fill_of_a_file_cut_after_mapping);
    RUN(test_page_fill_of_a_buffered_and_an_o_direct_file_on_one_reader);
    RUN(test_sampled_residency);
    RUN(test_ranged_residency);
    RUN(test_stats);
    RUN(test_stress);
    RUN(test_add_files_while_reading);
    RUN(test_external_files);
    RUN(test_read_pieces);
    RUN(test_read_pieces_failures);
    RUN(test_crc32c);
    printf("engine tests: %d passed, 0 failed\n", g_passed);
    return 0;
}
