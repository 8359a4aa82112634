/* se_read_pieces: a small run read on the caller's threads (see streamer_engine.h). */
#define _GNU_SOURCE
#include "streamer_engine.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#define IOV_BATCH 64     /* buffers one preadv() takes at most (IOV_MAX is 1024) */
#define MAX_HELPERS 256  /* threads started here when no team is given */

typedef struct piece_job {
    const se_piece *pieces;
    size_t n_pieces;
    const se_buffer *buffers;
    atomic_size_t next;   /* index of the next piece to take */
    atomic_int stopped;   /* set by the first failure: nobody takes another piece */
    pthread_mutex_t lock; /* guards error */
    se_error_info error;
} piece_job;

/* Moves (*next, *skip), a position in the piece's buffers, `bytes` forward; empty buffers are
 * stepped over. */
static void advance(const se_buffer *buffers, uint32_t n_buffers, uint32_t *next, uint64_t *skip,
                    uint64_t bytes) {
    while (*next < n_buffers) {
        uint64_t rest = buffers[*next].length - *skip;
        if (bytes < rest) {
            *skip += bytes;
            return;
        }
        bytes -= rest;
        (*next)++;
        *skip = 0;
    }
}

/* Reads one piece; SE_OK, or the failure in *failure (its `file` left for the caller). */
static int32_t read_piece(const se_piece *piece, const se_buffer *all, se_error_info *failure) {
    const se_buffer *buffers = all + piece->first_buffer;
    uint64_t total = 0;
    for (uint32_t i = 0; i < piece->n_buffers; i++) {
        total += buffers[i].length;
    }
    struct iovec iov[IOV_BATCH];
    uint32_t next = 0;
    uint64_t skip = 0;
    uint64_t done = 0;
    advance(buffers, piece->n_buffers, &next, &skip, 0);
    while (next < piece->n_buffers) {
        int count = 0;
        for (uint32_t i = next; i < piece->n_buffers && count < IOV_BATCH; i++) {
            uint64_t from = i == next ? skip : 0;
            iov[count].iov_base = (char *)buffers[i].address + from;
            iov[count].iov_len = (size_t)(buffers[i].length - from);
            count++;
        }
        ssize_t n = preadv(piece->fd, iov, count, (off_t)(piece->offset + done));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            failure->code = n < 0 ? SE_ERR_READ : SE_ERR_TRUNCATED;
            failure->sys_errno = n < 0 ? errno : 0;
            failure->offset = piece->offset + done;
            failure->expected = total;
            failure->got = done;
            return failure->code;
        }
        done += (uint64_t)n;
        advance(buffers, piece->n_buffers, &next, &skip, (uint64_t)n);
    }
    return SE_OK;
}

/* A team member's work: takes pieces until none is left or one has failed. */
static void read_taken(void *arg) {
    piece_job *job = arg;
    while (!atomic_load(&job->stopped)) {
        size_t index = atomic_fetch_add(&job->next, 1);
        if (index >= job->n_pieces) {
            return;
        }
        se_error_info failure = {0};
        if (read_piece(&job->pieces[index], job->buffers, &failure) == SE_OK) {
            continue;
        }
        failure.file = (int32_t)index;
        pthread_mutex_lock(&job->lock);
        if (job->error.code == SE_OK) {
            job->error = failure;
        }
        pthread_mutex_unlock(&job->lock);
        atomic_store(&job->stopped, 1);
    }
}

static void *helper_main(void *arg) {
    read_taken(arg);
    return NULL;
}

/* Runs read_taken on the calling thread and up to n_threads - 1 threads started here. */
static void read_on_own_threads(piece_job *job, uint32_t n_threads) {
    pthread_t helpers[MAX_HELPERS];
    uint32_t wanted = n_threads > MAX_HELPERS ? MAX_HELPERS : n_threads - 1;
    uint32_t started = 0;
    while (started < wanted && pthread_create(&helpers[started], NULL, helper_main, job) == 0) {
        started++;
    }
    read_taken(job);
    for (uint32_t i = 0; i < started; i++) {
        pthread_join(helpers[i], NULL);
    }
}

static int pieces_are_valid(const se_piece *pieces, size_t n_pieces, size_t n_buffers) {
    if (n_pieces > INT32_MAX) {
        return 0;
    }
    for (size_t i = 0; i < n_pieces; i++) {
        if (pieces[i].first_buffer > n_buffers || pieces[i].n_buffers > n_buffers - pieces[i].first_buffer) {
            return 0;
        }
    }
    return 1;
}

int32_t se_read_pieces(const se_piece *pieces, size_t n_pieces, const se_buffer *buffers,
                       size_t n_buffers, uint32_t n_threads, se_team_fn team, se_error_info *error) {
    memset(error, 0, sizeof(*error));
    error->code = SE_OK;
    error->file = -1;
    if ((n_pieces > 0 && pieces == NULL) || (n_buffers > 0 && buffers == NULL) ||
        !pieces_are_valid(pieces, n_pieces, n_buffers)) {
        error->code = SE_ERR_INVALID;
        return SE_ERR_INVALID;
    }
    piece_job job = {.pieces = pieces, .n_pieces = n_pieces, .buffers = buffers};
    atomic_init(&job.next, 0);
    atomic_init(&job.stopped, 0);
    job.error = *error;
    if (pthread_mutex_init(&job.lock, NULL) != 0) {
        error->code = SE_ERR_NOMEM;
        return SE_ERR_NOMEM;
    }
    uint32_t threads = n_threads == 0 ? 1 : n_threads;
    if (threads > n_pieces) {
        threads = n_pieces > 0 ? (uint32_t)(n_pieces < UINT32_MAX ? n_pieces : UINT32_MAX) : 1;
    }
    if (team != NULL && threads > 1) {
        team(read_taken, &job, threads, 0);
    } else {
        read_on_own_threads(&job, threads);
    }
    pthread_mutex_destroy(&job.lock);
    *error = job.error;
    return error->code;
}
