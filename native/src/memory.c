/* Destination memory: private anonymous mappings, optionally on huge pages.
 * Private (not shared) mappings are what the kernel backs with transparent
 * huge pages, which makes first touch roughly twice as fast. */
#define _GNU_SOURCE
#include "streamer_engine.h"

#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#define HUGE_PAGE ((size_t)2 << 20)

static size_t round_up(size_t value, size_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

void *se_alloc(size_t size, int32_t hugepage) {
    if (size == 0) {
        size = 1;
    }
    if (!hugepage) {
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    size_t length = round_up(size, HUGE_PAGE);
    /* Over-map by one huge page, then trim both ends to a 2 MiB aligned region. */
    char *raw = mmap(NULL, length + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        return NULL;
    }
    char *aligned = (char *)round_up((size_t)(uintptr_t)raw, HUGE_PAGE);
    size_t head = (size_t)(aligned - raw);
    size_t tail = HUGE_PAGE - head;
    if ((head > 0 && munmap(raw, head) != 0) || (tail > 0 && munmap(aligned + length, tail) != 0)) {
        munmap(raw, length + HUGE_PAGE);
        return NULL;
    }
    /* Advice is best effort: without THP the memory still works, only slower. */
    (void)madvise(aligned, length, MADV_HUGEPAGE);
    return aligned;
}

void se_free(void *ptr, size_t size, int32_t hugepage) {
    if (ptr == NULL) {
        return;
    }
    if (size == 0) {
        size = 1;
    }
    (void)munmap(ptr, hugepage ? round_up(size, HUGE_PAGE) : size);
}

/* One madvise holds the process's mmap lock over its whole range (~30 ms for 64 MiB here): 2 MiB
 * steps bound how long a thread that needs the lock meanwhile (an mmap, a page fault that falls back
 * to it) can wait. */
#define POPULATE_STEP ((uintptr_t)2 << 20)

int32_t se_populate(void *ptr, size_t size, int32_t *sys_errno) {
    *sys_errno = 0;
    if (ptr == NULL || size == 0) {
        return SE_OK;
    }
#ifdef MADV_POPULATE_WRITE
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t end = (uintptr_t)ptr + size;
    /* madvise wants a page-aligned start: the page holding ptr is part of the same mapping. */
    uintptr_t at = (uintptr_t)ptr & ~((uintptr_t)(page > 0 ? page : 4096) - 1);
    while (at < end) {
        uintptr_t step = end - at < POPULATE_STEP ? end - at : POPULATE_STEP;
        if (madvise((void *)at, step, MADV_POPULATE_WRITE) != 0) {
            *sys_errno = errno;
            return SE_ERR_INVALID;
        }
        at += step;
    }
    return SE_OK;
#else
    *sys_errno = EINVAL;
    return SE_ERR_INVALID;
#endif
}
