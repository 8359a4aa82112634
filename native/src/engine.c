/*
 * The reader pool. One mutex guards all shared state: blocks are megabytes,
 * so a few thousand lock operations a second cost nothing measurable, and a
 * single lock keeps the invariants easy to read.
 */
#define _GNU_SOURCE
#include "fill.h"
#include "streamer_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef struct se_file {
    int fd;          /* -1: an external file, read by someone else */
    int buffered_fd; /* fd itself for a buffered file; its own descriptor beside an O_DIRECT fd */
    const char *map; /* a buffered file, mapped read-only (owned) for the page fill; NULL: none */
    uint64_t map_length; /* the file's size when it was mapped */
} se_file;

/* The page fill a reader places SE_BLOCK_FILL blocks through (se_engine_set_fill). */
typedef struct {
    int fd;              /* the userfaultfd (borrowed) */
    uint64_t view_bytes; /* a reader unmaps the file pages it placed once they span this much */
} page_fill;

struct se_engine {
    pthread_mutex_t lock;
    pthread_cond_t work_ready; /* a block was queued, or the run stopped */
    pthread_cond_t done_ready; /* a unit completed, or the run failed */

    pthread_t *workers;
    uint32_t n_workers;

    se_file *files;
    int32_t n_files;
    int32_t files_capacity;

    se_unit *units;
    uint64_t *remaining; /* bytes of each unit not yet read */
    uint32_t n_units;

    se_block *queue; /* FIFO: blocks[queue_head, queue_tail) are pending */
    size_t queue_head;
    size_t queue_tail;
    size_t queue_capacity;

    uint32_t *done; /* completed unit ids; each unit appears at most once */
    size_t done_head;
    size_t done_tail;

    page_fill fill; /* what SE_BLOCK_FILL blocks go through; fill.fd -1: none */

    int stopping; /* destroy: workers exit once idle */
    int cancelled;
    se_error_info error;
    se_stats stats;
};

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Caller holds the lock. Keeps the first failure only. */
static void record_error(se_engine *e, int32_t code, int32_t sys_errno, const se_block *b,
                         uint64_t got) {
    if (e->error.code == SE_OK) {
        e->error.code = code;
        e->error.sys_errno = sys_errno;
        e->error.file = b ? b->file : -1;
        e->error.offset = b ? b->read_offset : 0;
        e->error.expected = b ? b->acc_end - b->read_offset : 0;
        e->error.got = got;
    }
    e->queue_head = e->queue_tail; /* stop new work; in-flight reads drain */
    pthread_cond_broadcast(&e->done_ready);
}

/* Reads [offset, offset + length) of fd into dst, stopping early only at end of file; *got = bytes
 * obtained. Returns SE_OK, or SE_ERR_READ with *sys_errno. */
static int32_t read_range(int fd, char *dst, uint64_t offset, uint64_t length, uint64_t acc_end,
                          uint64_t *got, int *sys_errno) {
    uint64_t done = 0;
    while (done < length) {
        ssize_t n = pread(fd, dst + done, (size_t)(length - done), (off_t)(offset + done));
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            *got = done;
            *sys_errno = errno;
            return SE_ERR_READ;
        }
        if (n == 0) {
            break; /* end of file */
        }
        done += (uint64_t)n;
        if (done < length && offset + done >= acc_end) {
            break; /* short read at end of file; an O_DIRECT retry at this unaligned offset could fail */
        }
    }
    *got = done;
    return SE_OK;
}

/* Reads the block; returns SE_OK or a status, with *got = bytes obtained. */
static int32_t read_block(int fd, const se_block *b, uint64_t *got, int *sys_errno) {
    int32_t status =
        read_range(fd, (char *)b->dst, b->read_offset, b->read_length, b->acc_end, got, sys_errno);
    if (status != SE_OK) {
        return status;
    }
    return b->read_offset + *got >= b->acc_end ? SE_OK : SE_ERR_TRUNCATED;
}

/* Places the whole pages [offset, offset + length) of a mapped file straight from the page cache
 * into dst. Only pages the file held when mapped and the cache holds now: a page missing from the
 * cache would be read a fault at a time, where a read asks for the whole chunk. The file must still
 * be as long after the copy, or a page cut by a truncation may have been copied as zeros. Returns 1
 * if every page was placed; 0 if the caller must read the range instead (pages placed already are
 * overwritten then, as pages that exist). */
static int place_from_cache(const se_file *file, int fill_fd, char *dst, uint64_t offset, uint64_t length) {
    unsigned char resident[SE_FILL_CHUNK / SE_DIRECT_ALIGNMENT];
    if (file->map == NULL || length > SE_FILL_CHUNK || offset + length > file->map_length) {
        return 0;
    }
    char *src = (char *)file->map + offset;
    if (mincore(src, length, resident) != 0) {
        return 0;
    }
    for (uint64_t page = 0; page < length / SE_DIRECT_ALIGNMENT; page++) {
        if ((resident[page] & 1) == 0) {
            return 0;
        }
    }
    int sys_errno = 0;
    int placed = se_fill_place(fill_fd, dst, src, (size_t)length, &sys_errno) == 0;
    struct stat now;
    return placed && fstat(file->buffered_fd, &now) == 0 && (uint64_t)now.st_size >= offset + length;
}

/* The span of a file's mapping that a reader placed pages from and has not unmapped yet. */
typedef struct {
    uint64_t begin;
    uint64_t end;
} mapped_view;

/* Unmaps the view once it spans at least min_bytes (0: whatever it spans), so that the resident
 * set stays the tensors (the cache keeps the pages) give or take min_bytes per reader. Each
 * unmapping flushes the TLB of every core running the process. Failing only leaves the pages
 * mapped, no byte differs. */
static void unmap_view(const se_file *file, mapped_view *view, uint64_t min_bytes) {
    if (view->end > view->begin && view->end - view->begin >= min_bytes) {
        (void)madvise((char *)file->map + view->begin, (size_t)(view->end - view->begin), MADV_DONTNEED);
        view->begin = view->end;
    }
}

/* Reads a SE_BLOCK_FILL block chunk by chunk into bounce (SE_FILL_CHUNK bytes of a buffered fd,
 * SE_FILL_DIRECT_CHUNK of an O_DIRECT one) and places each
 * chunk's whole pages through the page fill, a last page cut short by the end of the file completed
 * with zeros; a chunk the page cache holds goes straight from the file's mapping (view: what of it
 * is still mapped). Returns like read_block; SE_ERR_FILL with *sys_errno if placing failed. */
static int32_t fill_chunks(int fd, const se_file *file, const page_fill *fill, char *bounce,
                           const se_block *b, mapped_view *view, uint64_t *got, uint64_t *filled,
                           uint64_t *mapped, int *sys_errno) {
    char *dst = (char *)b->dst;
    uint64_t chunk = fd == file->buffered_fd ? SE_FILL_CHUNK : SE_FILL_DIRECT_CHUNK;
    uint64_t done = 0;
    while (done < b->read_length) {
        uint64_t want = b->read_length - done < chunk ? b->read_length - done : chunk;
        if (place_from_cache(file, fill->fd, dst + done, b->read_offset + done, want)) {
            *filled += want;
            *mapped += want;
            done += want;
            view->end = b->read_offset + done;
            unmap_view(file, view, fill->view_bytes);
            continue;
        }
        uint64_t have = 0;
        int32_t status = read_range(fd, bounce, b->read_offset + done, want, b->acc_end, &have, sys_errno);
        if (status != SE_OK) {
            *got = done + have;
            return status;
        }
        size_t pages = (size_t)(have + SE_DIRECT_ALIGNMENT - 1) / SE_DIRECT_ALIGNMENT * SE_DIRECT_ALIGNMENT;
        memset(bounce + have, 0, pages - (size_t)have);
        if (pages > 0 && se_fill_place(fill->fd, dst + done, bounce, pages, sys_errno) != 0) {
            *got = done;
            return SE_ERR_FILL;
        }
        *filled += pages;
        done += have;
        if (have < want) {
            break; /* end of file */
        }
    }
    *got = done;
    return b->read_offset + done >= b->acc_end ? SE_OK : SE_ERR_TRUNCATED;
}

/* fill_chunks, then what it left of the file's mapping mapped is unmapped. */
static int32_t fill_block(int fd, const se_file *file, const page_fill *fill, char *bounce,
                          const se_block *b, uint64_t *got, uint64_t *filled, uint64_t *mapped,
                          int *sys_errno) {
    mapped_view view = {.begin = b->read_offset, .end = b->read_offset};
    int32_t status = fill_chunks(fd, file, fill, bounce, b, &view, got, filled, mapped, sys_errno);
    unmap_view(file, &view, 0);
    return status;
}

/* Caller holds the lock. Credits the block's bytes to the units it overlaps. */
static void credit_units(se_engine *e, const se_block *b) {
    for (uint32_t u = b->first_unit; u <= b->last_unit; u++) {
        const se_unit *unit = &e->units[u];
        uint64_t lo = unit->begin > b->acc_begin ? unit->begin : b->acc_begin;
        uint64_t hi = unit->end < b->acc_end ? unit->end : b->acc_end;
        if (hi <= lo || e->remaining[u] == 0) {
            continue;
        }
        uint64_t bytes = hi - lo;
        e->remaining[u] = bytes >= e->remaining[u] ? 0 : e->remaining[u] - bytes;
        if (e->remaining[u] == 0) {
            e->done[e->done_tail++] = u;
        }
    }
    pthread_cond_broadcast(&e->done_ready);
}

static int direct_aligned(const se_block *b) {
    return (b->read_offset | b->read_length | (uint64_t)(uintptr_t)b->dst) % SE_DIRECT_ALIGNMENT == 0;
}

/* A buffered read needs no alignment: it reads only the credited bytes, into their place in dst. */
static void trim_to_credited(se_block *b) {
    b->dst = (char *)b->dst + (b->acc_begin - b->read_offset);
    b->read_length = b->acc_end - b->acc_begin;
    b->read_offset = b->acc_begin;
}

/* A worker's buffers for page-fill reads, each made at its first use and reused for every block.
 * An O_DIRECT read lands in `direct` (SE_FILL_DIRECT_CHUNK bytes, aligned, on huge pages): it goes
 * to the device as one request per run of physically contiguous pages, up to the queue's limits;
 * into scattered 4 KiB pages a virtio disk got ~0.5-0.8 MiB requests and read 8 MiB blocks at
 * 0.6-0.8 GB/s, into huge pages 4 MiB requests at 2.7-2.9 GB/s (benchmarks/README.md). A read
 * through the page cache lands in `buffered` (SE_FILL_CHUNK bytes of 4 KiB pages): it needs no
 * contiguous pages, and a warm load reads only the few chunks that lost pages to reclaim, where
 * one huge page per reader was touched for it (on a VM whose host takes free memory back, a fresh
 * huge page took 5-16 ms to touch). Warm 1 GiB, paired rounds against the huge-page buffer:
 * 1.10x [1.01, 1.17] (10 rounds, engine builds swapped) and 1.02x [0.95, 1.09] (12 rounds,
 * streamer-bench --baseline), 2026-12-02: the memory it spares, not speed. */
typedef struct {
    char *buffered;
    char *direct;
} bounce_buffers;

/* The buffer for a page-fill read from fd: made now if it is the first; NULL if out of memory. */
static char *bounce_for(bounce_buffers *bounce, int direct) {
    if (direct) {
        return bounce->direct != NULL ? bounce->direct : (bounce->direct = se_alloc(SE_FILL_DIRECT_CHUNK, 1));
    }
    return bounce->buffered != NULL ? bounce->buffered : (bounce->buffered = se_alloc(SE_FILL_CHUNK, 0));
}

static void *worker_main(void *arg) {
    se_engine *e = (se_engine *)arg;
    bounce_buffers bounce = {NULL, NULL};
    pthread_mutex_lock(&e->lock);
    for (;;) {
        double idle_start = now_seconds();
        while (e->queue_head == e->queue_tail && !e->stopping) {
            pthread_cond_wait(&e->work_ready, &e->lock);
        }
        e->stats.idle_seconds += now_seconds() - idle_start;
        if (e->queue_head == e->queue_tail) {
            break; /* stopping and nothing left */
        }
        se_block block = e->queue[e->queue_head++];
        se_file file = e->files[block.file]; /* add_file may move the table once unlocked */
        int fill = (block.flags & SE_BLOCK_FILL) != 0;
        page_fill lent_fill = e->fill;
        int fd = file.fd != file.buffered_fd && !direct_aligned(&block) ? file.buffered_fd : file.fd;
        if (fd == file.buffered_fd && !fill) {
            trim_to_credited(&block);
        }
        pthread_mutex_unlock(&e->lock);

        uint64_t got = 0;
        uint64_t filled = 0;
        uint64_t mapped = 0;
        int sys_errno = 0;
        double read_start = now_seconds();
        int32_t status;
        char *fill_buffer = NULL;
        if (!fill) {
            status = read_block(fd, &block, &got, &sys_errno);
        } else if ((fill_buffer = bounce_for(&bounce, fd != file.buffered_fd)) == NULL) {
            status = SE_ERR_NOMEM;
        } else {
            status = fill_block(fd, &file, &lent_fill, fill_buffer, &block, &got, &filled, &mapped, &sys_errno);
        }
        double read_seconds = now_seconds() - read_start;

        pthread_mutex_lock(&e->lock);
        e->stats.read_seconds += read_seconds;
        e->stats.bytes_read += got;
        e->stats.bytes_filled += filled;
        e->stats.bytes_mapped += mapped;
        if (status != SE_OK) {
            record_error(e, status, sys_errno, &block, got);
        } else if (e->error.code == SE_OK) {
            e->stats.blocks_done++;
            credit_units(e, &block);
        }
    }
    pthread_mutex_unlock(&e->lock);
    se_free(bounce.buffered, SE_FILL_CHUNK, 0);
    se_free(bounce.direct, SE_FILL_DIRECT_CHUNK, 1);
    return NULL;
}

/* Unmaps a file and closes its descriptors (-1: none; the same descriptor twice for a buffered file). */
static void close_file(const se_file *file) {
    if (file->map != NULL) {
        munmap((void *)file->map, (size_t)file->map_length);
    }
    if (file->fd >= 0) {
        close(file->fd);
    }
    if (file->buffered_fd >= 0 && file->buffered_fd != file->fd) {
        close(file->buffered_fd);
    }
}

static void free_engine(se_engine *e) {
    free(e->workers);
    free(e->files);
    free(e->units);
    free(e->remaining);
    free(e->queue);
    free(e->done);
    free(e);
}

/* Stops and joins the first started_workers workers, closes files, frees everything. */
static void teardown(se_engine *e, uint32_t started_workers) {
    pthread_mutex_lock(&e->lock);
    e->stopping = 1;
    e->queue_head = e->queue_tail;
    pthread_cond_broadcast(&e->work_ready);
    pthread_mutex_unlock(&e->lock);
    for (uint32_t i = 0; i < started_workers; i++) {
        pthread_join(e->workers[i], NULL);
    }
    for (int32_t i = 0; i < e->n_files; i++) {
        close_file(&e->files[i]);
    }
    pthread_cond_destroy(&e->done_ready);
    pthread_cond_destroy(&e->work_ready);
    pthread_mutex_destroy(&e->lock);
    free_engine(e);
}

/* Initialises the lock and both conditions, or none of them. */
static int init_sync(se_engine *e) {
    if (pthread_mutex_init(&e->lock, NULL) != 0) {
        return 0;
    }
    if (pthread_cond_init(&e->work_ready, NULL) != 0) {
        pthread_mutex_destroy(&e->lock);
        return 0;
    }
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) != 0) {
        pthread_cond_destroy(&e->work_ready);
        pthread_mutex_destroy(&e->lock);
        return 0;
    }
    /* Timeouts on the monotonic clock: wall-clock jumps must not stretch a wait. */
    int ok = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) == 0 &&
             pthread_cond_init(&e->done_ready, &attr) == 0;
    pthread_condattr_destroy(&attr);
    if (!ok) {
        pthread_cond_destroy(&e->work_ready);
        pthread_mutex_destroy(&e->lock);
        return 0;
    }
    return 1;
}

int32_t se_abi_version(void) {
    return SE_ABI_VERSION;
}

se_engine *se_engine_create(uint32_t n_workers, const se_unit *units, uint32_t n_units,
                            int32_t *status) {
    if (n_workers == 0 || (n_units > 0 && units == NULL)) {
        *status = SE_ERR_INVALID;
        return NULL;
    }
    se_engine *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        *status = SE_ERR_NOMEM;
        return NULL;
    }
    size_t unit_slots = n_units > 0 ? n_units : 1;
    e->workers = calloc(n_workers, sizeof(*e->workers));
    e->units = calloc(unit_slots, sizeof(*e->units));
    e->remaining = calloc(unit_slots, sizeof(*e->remaining));
    e->done = calloc(unit_slots, sizeof(*e->done));
    if (e->workers == NULL || e->units == NULL || e->remaining == NULL || e->done == NULL) {
        free_engine(e);
        *status = SE_ERR_NOMEM;
        return NULL;
    }
    for (uint32_t i = 0; i < n_units; i++) {
        if (units[i].end <= units[i].begin || units[i].file < 0 ||
            units[i].need > units[i].end - units[i].begin) {
            free_engine(e);
            *status = SE_ERR_INVALID;
            return NULL;
        }
        e->units[i] = units[i];
        e->remaining[i] = units[i].need != 0 ? units[i].need : units[i].end - units[i].begin;
    }
    if (!init_sync(e)) {
        free_engine(e);
        *status = SE_ERR_NOMEM;
        return NULL;
    }
    e->n_units = n_units;
    e->fill.fd = -1;
    e->error.code = SE_OK;
    e->error.file = -1;
    e->n_workers = n_workers;
    for (uint32_t i = 0; i < n_workers; i++) {
        if (pthread_create(&e->workers[i], NULL, worker_main, e) != 0) {
            teardown(e, i);
            *status = SE_ERR_THREAD;
            return NULL;
        }
    }
    *status = SE_OK;
    return e;
}

/* Maps a buffered file for the page fill to place cached pages from (place_from_cache); only once
 * the engine has a page fill. Without a mapping the fill reads every chunk: an O_DIRECT or external
 * file, an empty one, mmap refused, or a process with a limit on its address space, which the
 * mapping would spend on bytes that the buffers need too. */
static void map_for_fill(se_file *file) {
    if (file->map != NULL || file->fd < 0 || file->fd != file->buffered_fd) {
        return;
    }
    struct rlimit address_space;
    if (getrlimit(RLIMIT_AS, &address_space) != 0 || address_space.rlim_cur != RLIM_INFINITY) {
        return;
    }
    struct stat st;
    if (fstat(file->buffered_fd, &st) != 0 || st.st_size <= 0) {
        return;
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, file->buffered_fd, 0);
    if (map != MAP_FAILED) {
        file->map = map;
        file->map_length = (uint64_t)st.st_size;
    }
}

/* Appends a file entry, mapped if the engine has a page fill; returns its index or SE_ERR_NOMEM
 * (the file is not closed on failure). */
static int32_t append_file(se_engine *e, se_file file) {
    pthread_mutex_lock(&e->lock);
    if (e->n_files == e->files_capacity) {
        int32_t capacity = e->files_capacity ? e->files_capacity * 2 : 8;
        se_file *grown = realloc(e->files, (size_t)capacity * sizeof(*grown));
        if (grown == NULL) {
            pthread_mutex_unlock(&e->lock);
            return SE_ERR_NOMEM;
        }
        e->files = grown;
        e->files_capacity = capacity;
    }
    int32_t index = e->n_files++;
    e->files[index] = file;
    if (e->fill.fd >= 0) {
        map_for_fill(&e->files[index]);
    }
    pthread_mutex_unlock(&e->lock);
    return index;
}

/* open(2) that never blocks (a FIFO put in a file's place would, until a writer comes) and gives
 * regular files only: -1 with errno EINVAL for anything else. */
static int open_regular(const char *path, int flags) {
    int fd = open(path, flags | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        return -1;
    }
    struct stat st;
    int failure = 0;
    if (fstat(fd, &st) != 0) {
        failure = errno;
    } else if (!S_ISREG(st.st_mode)) {
        failure = EINVAL;
    }
    if (failure != 0) {
        close(fd);
        errno = failure;
        return -1;
    }
    return fd;
}

int32_t se_engine_add_file(se_engine *e, const char *path, int32_t want_direct, int32_t *is_direct,
                           int32_t *sys_errno) {
    *is_direct = 0;
    *sys_errno = 0;
    int fd = -1;
    if (want_direct) {
        fd = open_regular(path, O_RDONLY | O_DIRECT);
        *is_direct = fd >= 0;
    }
    int buffered_fd = open_regular(path, O_RDONLY);
    if (buffered_fd < 0) {
        *sys_errno = errno;
        if (fd >= 0) {
            close(fd);
        }
        *is_direct = 0;
        return SE_ERR_OPEN;
    }
    se_file file = {.fd = fd < 0 ? buffered_fd : fd, .buffered_fd = buffered_fd};
    int32_t index = append_file(e, file);
    if (index < 0) {
        close_file(&file);
    }
    return index;
}

int32_t se_engine_set_fill(se_engine *e, int32_t fill_fd, uint64_t view_bytes) {
    if (fill_fd < 0) {
        return SE_ERR_INVALID;
    }
    pthread_mutex_lock(&e->lock);
    e->fill = (page_fill){.fd = fill_fd, .view_bytes = view_bytes};
    for (int32_t i = 0; i < e->n_files; i++) {
        map_for_fill(&e->files[i]);
    }
    pthread_mutex_unlock(&e->lock);
    return SE_OK;
}

int32_t se_engine_add_external_file(se_engine *e) {
    se_file external = {.fd = -1, .buffered_fd = -1};
    return append_file(e, external);
}

/* A page-fill block places whole pages: it needs the engine's page fill and page-aligned numbers. */
static int flags_are_valid(const se_engine *e, const se_block *b, int external) {
    if (b->flags == 0) {
        return 1;
    }
    return b->flags == SE_BLOCK_FILL && !external && e->fill.fd >= 0 && direct_aligned(b);
}

/* Caller holds the lock. external: the block must be of an external file (else of a local one). */
static int block_is_valid(const se_engine *e, const se_block *b, int external) {
    int valid = b->file >= 0 && b->file < e->n_files && (e->files[b->file].fd < 0) == external &&
           b->dst != NULL && b->first_unit <= b->last_unit &&
           b->last_unit < e->n_units && b->read_offset <= b->acc_begin && b->acc_begin < b->acc_end &&
           b->acc_end <= b->read_offset + b->read_length && flags_are_valid(e, b, external);
    for (uint32_t u = b->first_unit; valid && u <= b->last_unit; u++) {
        valid = e->units[u].file == b->file;
    }
    return valid;
}

int32_t se_engine_submit(se_engine *e, const se_block *blocks, size_t n_blocks) {
    pthread_mutex_lock(&e->lock);
    for (size_t i = 0; i < n_blocks; i++) {
        if (!block_is_valid(e, &blocks[i], 0)) {
            pthread_mutex_unlock(&e->lock);
            return SE_ERR_INVALID;
        }
    }
    if (e->cancelled || e->error.code != SE_OK) {
        int32_t code = e->cancelled ? SE_ERR_CANCELLED : e->error.code;
        pthread_mutex_unlock(&e->lock);
        return code;
    }
    size_t pending = e->queue_tail - e->queue_head;
    if (pending + n_blocks > e->queue_capacity || e->queue_tail + n_blocks > e->queue_capacity) {
        /* Compact to the front, growing if needed. */
        size_t capacity = e->queue_capacity ? e->queue_capacity : 64;
        while (capacity < pending + n_blocks) {
            capacity *= 2;
        }
        se_block *grown = malloc(capacity * sizeof(*grown));
        if (grown == NULL) {
            pthread_mutex_unlock(&e->lock);
            return SE_ERR_NOMEM;
        }
        if (pending > 0) {
            memcpy(grown, e->queue + e->queue_head, pending * sizeof(*grown));
        }
        free(e->queue);
        e->queue = grown;
        e->queue_capacity = capacity;
        e->queue_head = 0;
        e->queue_tail = pending;
    }
    memcpy(e->queue + e->queue_tail, blocks, n_blocks * sizeof(*blocks));
    e->queue_tail += n_blocks;
    pthread_cond_broadcast(&e->work_ready);
    pthread_mutex_unlock(&e->lock);
    return SE_OK;
}

int32_t se_engine_credit(se_engine *e, const se_block *b) {
    pthread_mutex_lock(&e->lock);
    int32_t status = SE_OK;
    if (!block_is_valid(e, b, 1)) {
        status = SE_ERR_INVALID;
    } else if (e->cancelled || e->error.code != SE_OK) {
        status = e->cancelled ? SE_ERR_CANCELLED : e->error.code;
    } else {
        e->stats.bytes_read += b->acc_end - b->acc_begin;
        e->stats.blocks_done++;
        credit_units(e, b);
    }
    pthread_mutex_unlock(&e->lock);
    return status;
}

int32_t se_engine_fail(se_engine *e, const se_error_info *info) {
    if (info == NULL || info->code >= SE_OK) {
        return SE_ERR_INVALID;
    }
    pthread_mutex_lock(&e->lock);
    if (e->error.code == SE_OK) {
        e->error = *info;
    }
    e->queue_head = e->queue_tail;
    pthread_cond_broadcast(&e->done_ready);
    pthread_mutex_unlock(&e->lock);
    return SE_OK;
}

int32_t se_engine_wait(se_engine *e, uint32_t *unit_ids, size_t max_ids, int32_t timeout_ms,
                       size_t *n_out) {
    *n_out = 0;
    if (timeout_ms < 0) {
        return SE_ERR_INVALID;
    }
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += timeout_ms / 1000;
    deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec += 1;
        deadline.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&e->lock);
    while (e->done_head == e->done_tail && e->error.code == SE_OK && !e->cancelled) {
        if (pthread_cond_timedwait(&e->done_ready, &e->lock, &deadline) == ETIMEDOUT) {
            break;
        }
    }
    int32_t status = e->cancelled ? SE_ERR_CANCELLED : e->error.code;
    if (status == SE_OK) {
        while (*n_out < max_ids && e->done_head < e->done_tail) {
            unit_ids[(*n_out)++] = e->done[e->done_head++];
        }
    }
    pthread_mutex_unlock(&e->lock);
    return status;
}

void se_engine_error(se_engine *e, se_error_info *out) {
    pthread_mutex_lock(&e->lock);
    *out = e->error;
    pthread_mutex_unlock(&e->lock);
}

void se_engine_stats(se_engine *e, se_stats *out) {
    pthread_mutex_lock(&e->lock);
    *out = e->stats;
    pthread_mutex_unlock(&e->lock);
}

void se_engine_cancel(se_engine *e) {
    pthread_mutex_lock(&e->lock);
    e->cancelled = 1;
    e->queue_head = e->queue_tail;
    pthread_cond_broadcast(&e->done_ready);
    pthread_mutex_unlock(&e->lock);
}

void se_engine_destroy(se_engine *e) {
    if (e != NULL) {
        teardown(e, e->n_workers);
    }
}
