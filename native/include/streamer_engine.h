/*
 * streamer engine: a pool of reader threads that copies byte ranges of files
 * into caller-owned memory and reports when each "unit" (a tensor) is whole.
 *
 * Ownership: the caller owns every destination buffer and must keep it alive
 * until se_engine_destroy() returns (destroy drains in-flight reads first).
 * The engine owns its threads and file descriptors and releases them in
 * se_engine_destroy(). There is no global state; every function but the
 * memory helpers takes the engine it acts on.
 *
 * Threading: all functions may be called from one controlling thread while
 * the workers run; se_engine_wait() blocks and is meant to be called with the
 * Python GIL released (cffi does this).
 *
 * This header is the only declaration of the ABI: the Python binding feeds its
 * declarations to cffi and reads its constants, so it must stay plain C (one
 * declaration per statement, integer constants as `#define SE_NAME value`).
 */
#ifndef STREAMER_ENGINE_H
#define STREAMER_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on every change to a struct layout, a signature or a constant below. The binding
 * refuses a library whose se_abi_version() differs from the header it was installed with. */
#define SE_ABI_VERSION 9

/* O_DIRECT reads need offset, length and destination on multiples of this. */
#define SE_DIRECT_ALIGNMENT 4096

/* Status codes: 0 is success, every failure is negative. */
#define SE_OK 0
#define SE_ERR_NOMEM (-1)     /* allocation failed */
#define SE_ERR_OPEN (-2)      /* open() failed; sys_errno says why */
#define SE_ERR_READ (-3)      /* pread() failed; sys_errno says why */
#define SE_ERR_TRUNCATED (-4) /* the file ended before the requested range */
#define SE_ERR_CANCELLED (-5) /* se_engine_cancel() was called */
#define SE_ERR_INVALID (-6)   /* bad argument (index out of range, bad range, ...) */
#define SE_ERR_THREAD (-7)    /* a worker thread could not be started */
#define SE_ERR_EXTERNAL (-8)  /* an external reader failed (se_engine_fail); it knows why */
#define SE_ERR_FILL (-9)      /* placing read bytes through the page fill failed; sys_errno says why */

/* se_block.flags */
#define SE_BLOCK_FILL 1 /* place the block's pages through the engine's page fill (se_engine_set_fill) */

/* Bytes a page-fill block is read in at a time, through a buffer of each reader's own: a buffered
 * file's chunk (a chunk the page cache holds is placed from the file's mapping), and an O_DIRECT
 * file's, whose read the device serves best in large requests. */
#define SE_FILL_CHUNK 1048576
#define SE_FILL_DIRECT_CHUNK 8388608

/*
 * A unit completes once `need` bytes of [begin, end) of its file have been credited: all of them
 * (need 0, a tensor), or only the scattered ranges its blocks cover (a sliced tensor read as many
 * ranges: need is their total). Blocks must never credit the same byte of a unit twice.
 */
typedef struct se_unit {
    int32_t file;   /* index returned by se_engine_add_file() */
    uint64_t begin; /* absolute file offset, inclusive */
    uint64_t end;   /* absolute file offset, exclusive; end > begin */
    uint64_t need;  /* bytes to credit, 0 < need <= end - begin; 0: end - begin */
} se_unit;

/*
 * One read. [read_offset, read_offset + read_length) is read into dst. The part
 * [acc_begin, acc_end) (inside the read range) is credited to the units
 * first_unit..last_unit that it overlaps. A read may end early only at end of
 * file, and only after acc_end: for O_DIRECT files the planner rounds reads out
 * to the alignment, which can run past EOF. A buffered read needs no alignment:
 * only the credited part is read (into dst + acc_begin - read_offset), the rest
 * of dst is left as it was. Blocks of an O_DIRECT file whose offset, length or
 * dst is off SE_DIRECT_ALIGNMENT are read buffered.
 *
 * A block flagged SE_BLOCK_FILL reads all of its range, SE_FILL_CHUNK bytes at a time
 * (SE_FILL_DIRECT_CHUNK for an O_DIRECT file), into a buffer of the reader's own (for an O_DIRECT
 * file on huge pages where the kernel has them), and places each chunk's whole pages into dst with the page fill
 * (see se_fill_open): its dst, read_offset and read_length must be multiples of
 * SE_DIRECT_ALIGNMENT, and a last page cut short by the end of the file is completed with zeros.
 * A chunk of a buffered file whose pages are all in the page cache is placed straight from a
 * mapping of the file instead: one copy where the read into the buffer makes two.
 */
typedef struct se_block {
    int32_t file;
    uint32_t first_unit;
    uint32_t last_unit; /* inclusive */
    uint32_t flags;     /* SE_BLOCK_* */
    uint64_t acc_begin;
    uint64_t acc_end;
    uint64_t read_offset;
    uint64_t read_length;
    void *dst;
} se_block;

/* The first failure of a run; later failures are dropped. */
typedef struct se_error_info {
    int32_t code;      /* SE_ERR_*, SE_OK when no failure happened */
    int32_t sys_errno; /* errno of the failing call, 0 if none */
    int32_t file;      /* file index, -1 if not about a file */
    uint64_t offset;   /* file offset where the failing read started */
    uint64_t expected; /* bytes the read needed */
    uint64_t got;      /* bytes the read obtained */
} se_error_info;

typedef struct se_stats {
    uint64_t bytes_read;  /* bytes returned by pread */
    uint64_t blocks_done; /* blocks fully read */
    uint64_t bytes_filled; /* bytes placed through the page fill (whole pages) */
    uint64_t bytes_mapped; /* of those, bytes placed straight from the page cache (a mapping of the file) */
    double read_seconds;  /* summed over workers: time inside pread */
    double idle_seconds;  /* summed over workers: time waiting for a block */
} se_stats;

typedef struct se_engine se_engine;

/* SE_ABI_VERSION as the library was compiled. */
int32_t se_abi_version(void);

/*
 * Creates an engine with n_workers threads and a copy of the unit table.
 * Returns NULL on failure and stores the reason in *status.
 */
se_engine *se_engine_create(uint32_t n_workers, const se_unit *units, uint32_t n_units,
                            int32_t *status);

/*
 * Opens a file for reading. want_direct asks for O_DIRECT (the file then holds a
 * second, buffered descriptor for blocks off the alignment); if the filesystem
 * refuses it the file is read buffered and *is_direct is 0. Returns the file
 * index (>= 0) or a negative status; *sys_errno gets errno on SE_ERR_OPEN.
 */
int32_t se_engine_add_file(se_engine *engine, const char *path, int32_t want_direct,
                           int32_t *is_direct, int32_t *sys_errno);

/*
 * External files: bytes that another reader (e.g. the S3 backend) fetches itself.
 * se_engine_add_external_file() registers one and returns its index (>= 0) or a
 * negative status; workers never read it and se_engine_submit() rejects its blocks.
 * The external reader reports each finished block with se_engine_credit(), which
 * credits the units exactly as a worker's read would (and counts
 * acc_end - acc_begin in bytes_read); it returns SE_OK, SE_ERR_INVALID for an
 * invalid block or one of a file that is not external, or the run's error /
 * SE_ERR_CANCELLED once the run has stopped (the block is then not credited).
 * se_engine_fail() stops the run with info (code must be negative) as its first
 * failure, exactly like a failed read: queued blocks are dropped and waiters wake.
 * Both may be called from any thread.
 */
int32_t se_engine_add_external_file(se_engine *engine);
int32_t se_engine_credit(se_engine *engine, const se_block *block);
int32_t se_engine_fail(se_engine *engine, const se_error_info *info);

/*
 * Page fill: fresh destination pages are created already holding the bytes read (userfaultfd's
 * UFFDIO_COPY), instead of being zeroed by a page fault and then written: on 4 KiB pages that
 * fault, not the copy, is what loading into fresh memory costs.
 *
 * se_fill_open() makes a page fill (a userfaultfd that takes no faults from the kernel, so an
 * unprivileged process may open it) and stores its descriptor in *fill_fd; it returns SE_OK, or
 * SE_ERR_INVALID with *sys_errno set where the kernel or a seccomp filter refuses (before Linux
 * 5.11: EINVAL; containers: often EPERM or ENOSYS). se_fill_register() makes the pages of
 * [ptr, ptr + size) of memory from se_alloc() (page-aligned, whole pages) fillable; until
 * se_fill_unregister() (or se_fill_close()), a page of it nobody filled must not be touched: a
 * read or write from user space waits until it is filled, from the kernel it fails (EFAULT).
 * Both return SE_OK or SE_ERR_INVALID with *sys_errno set. se_fill_close() closes the
 * descriptor, which unregisters whatever is still registered; -1 is a no-op.
 *
 * se_engine_set_fill() lends the engine a page fill for its SE_BLOCK_FILL blocks; the caller keeps
 * it open until se_engine_destroy() returns. A filled page that already exists (EEXIST) is
 * written plainly; any other refusal fails the run with SE_ERR_FILL. Chunks of a buffered file
 * that the page cache holds are placed from a mapping of the file: each reader unmaps the pages it
 * placed once they span view_bytes, and at each block's end (0: after every chunk). Those pages
 * count in the process's resident set while mapped, up to readers x view_bytes; each unmapping
 * costs a TLB flush on every core running the process.
 */
int32_t se_fill_open(int32_t *fill_fd, int32_t *sys_errno);
int32_t se_fill_register(int32_t fill_fd, void *ptr, size_t size, int32_t *sys_errno);
int32_t se_fill_unregister(int32_t fill_fd, void *ptr, size_t size, int32_t *sys_errno);
void se_fill_close(int32_t fill_fd);
int32_t se_engine_set_fill(se_engine *engine, int32_t fill_fd, uint64_t view_bytes);

/* Queues blocks behind those already queued (FIFO). A batch with an invalid block
 * (bad index, empty or misplaced credited range, a unit of another file, an unknown flag, a
 * SE_BLOCK_FILL block that is off the alignment or of an engine without a page fill) is
 * rejected whole with SE_ERR_INVALID. */
int32_t se_engine_submit(se_engine *engine, const se_block *blocks, size_t n_blocks);

/*
 * Waits up to timeout_ms for completed units and copies up to max_ids of
 * their indices into unit_ids, setting *n_out. Returns SE_OK (possibly with
 * *n_out == 0 on timeout), the run's first error code, or SE_ERR_INVALID for a
 * negative timeout.
 */
int32_t se_engine_wait(se_engine *engine, uint32_t *unit_ids, size_t max_ids, int32_t timeout_ms,
                       size_t *n_out);

/* Copies the run's first failure (code SE_OK if none). */
void se_engine_error(se_engine *engine, se_error_info *out);

/* Copies the counters gathered so far. */
void se_engine_stats(se_engine *engine, se_stats *out);

/* Drops queued blocks and makes waiters return SE_ERR_CANCELLED; in-flight reads finish. */
void se_engine_cancel(se_engine *engine);

/* Cancels, waits for in-flight reads, joins the workers, closes files, frees. NULL is a no-op. */
void se_engine_destroy(se_engine *engine);

/*
 * Pieces: a small run of local files read on the caller's own threads, without an engine (starting
 * and joining an engine's readers costs more than such a run's bytes). A piece fills n_buffers
 * buffers (buffers[first_buffer] on), back to back, from `offset` of the open descriptor fd.
 *
 * se_read_pieces() reads every piece, in any order, on n_threads threads: the calling thread and
 * n_threads - 1 more, the team's where `team` is given, else threads started here (fewer where one
 * cannot start: the caller reads on) and joined before it returns. It stops at the first failure,
 * which it returns and stores in *error: SE_ERR_READ (with sys_errno) or SE_ERR_TRUNCATED (the file
 * ended early), `file` the index of the failing piece, `offset` where its failing read started,
 * `expected` the piece's bytes and `got` those of them read. SE_ERR_INVALID: a piece's buffers lie
 * outside buffers[], or more than INT32_MAX pieces.
 *
 * se_team_fn is GOMP_parallel's signature (libgomp's, and the GOMP entry of LLVM's and Intel's
 * OpenMP runtimes): run work(arg) on a team of n_threads, the caller among them, and return once
 * every member has. Given torch's runtime, the reads run on the threads torch's own copies run on,
 * which spin awake for milliseconds after each operator: threads of our own would take turns with
 * them on the cores instead.
 */
typedef void (*se_team_fn)(void (*work)(void *), void *arg, unsigned int n_threads, unsigned int flags);

typedef struct se_buffer {
    uintptr_t address; /* first byte */
    uint64_t length;
} se_buffer;

typedef struct se_piece {
    uint64_t offset;
    int32_t fd;
    uint32_t first_buffer;
    uint32_t n_buffers;
} se_piece;

int32_t se_read_pieces(const se_piece *pieces, size_t n_pieces, const se_buffer *buffers,
                       size_t n_buffers, uint32_t n_threads, se_team_fn team, se_error_info *error);

/*
 * Anonymous private memory for destinations. With hugepage != 0 the region is
 * 2 MiB aligned and advised MADV_HUGEPAGE. Returns NULL on failure.
 * se_free() must get the same size that se_alloc() got.
 */
void *se_alloc(size_t size, int32_t hugepage);
void se_free(void *ptr, size_t size, int32_t hugepage);

/*
 * Faults [ptr, ptr + size) of memory from se_alloc() in, writable, without writing to it
 * (MADV_POPULATE_WRITE, 2 MiB at a time; ptr need not be page-aligned): safe while other threads
 * write into the same range, whose bytes it never changes. Returns SE_OK, or SE_ERR_INVALID with
 * *sys_errno set when the kernel cannot (EINVAL: older than Linux 5.14) or the range is not mapped.
 */
int32_t se_populate(void *ptr, size_t size, int32_t *sys_errno);

/* How many bytes of [offset, offset + length) of the file are in the page cache (mincore); the
 * range is clipped to the file (length UINT64_MAX: to its end) and *total gets the clipped
 * length. sample_every 1 counts every page; N > 1 looks at one 1 MiB window in every N and
 * scales, N times cheaper (mincore costs ~15 ms per cached GiB). Returns SE_OK or a status
 * (SE_ERR_INVALID for N == 0). */
int32_t se_resident_bytes(const char *path, uint64_t offset, uint64_t length, uint32_t sample_every,
                          uint64_t *resident, uint64_t *total, int32_t *sys_errno);

/*
 * CRC-32C (Castagnoli) of `length` bytes at `data`, continuing from `crc` (0 for the first bytes):
 * se_crc32c(se_crc32c(0, a, n), b, m) is the CRC of a followed by b. se_crc32c_combine gives the
 * CRC of A followed by B from crc(A), crc(B) and B's length, so pieces of an object read in any
 * order check it whole (Google Cloud Storage's per-object `crc32c`).
 */
uint32_t se_crc32c(uint32_t crc, const void *data, size_t length);
uint32_t se_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

#ifdef __cplusplus
}
#endif

#endif
