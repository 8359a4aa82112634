/* How much of a file sits in the page cache, so the loader can read cached
 * files buffered (a memcpy from cache) and uncached ones with O_DIRECT. */
#define _GNU_SOURCE
#include "streamer_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Pages looked at per sampled window: 1 MiB of 4 KiB pages, so a partly cached file
 * (a head read earlier, a tail evicted) still shows up in the estimate. */
#define WINDOW_PAGES ((size_t)256)

/* Bytes of page `index` (of a mapping starting at map_begin) that lie inside [begin, end). */
static uint64_t page_overlap(uint64_t map_begin, size_t index, size_t page, uint64_t begin, uint64_t end) {
    uint64_t first = map_begin + (uint64_t)index * page;
    uint64_t last = first + page;
    uint64_t lo = first > begin ? first : begin;
    uint64_t hi = last < end ? last : end;
    return hi > lo ? hi - lo : 0;
}

int32_t se_resident_bytes(const char *path, uint64_t offset, uint64_t length, uint32_t sample_every,
                          uint64_t *resident, uint64_t *total, int32_t *sys_errno) {
    *resident = 0;
    *total = 0;
    *sys_errno = 0;
    if (sample_every == 0) {
        return SE_ERR_INVALID;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* a FIFO in the file's place must not block */
    if (fd < 0) {
        *sys_errno = errno;
        return SE_ERR_OPEN;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        *sys_errno = errno;
        close(fd);
        return SE_ERR_READ;
    }
    uint64_t size = (uint64_t)st.st_size;
    uint64_t begin = offset < size ? offset : size;
    uint64_t end = length < size - begin ? begin + length : size;
    *total = end - begin;
    if (*total == 0) {
        close(fd);
        return SE_OK;
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uint64_t map_begin = begin - begin % page;
    size_t map_length = (size_t)(end - map_begin);
    void *map = mmap(NULL, map_length, PROT_READ, MAP_SHARED, fd, (off_t)map_begin);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED) {
        *sys_errno = map_errno;
        return SE_ERR_READ;
    }
    size_t pages = (map_length + page - 1) / page;
    unsigned char *vec = malloc(WINDOW_PAGES);
    if (vec == NULL) {
        munmap(map, map_length);
        return SE_ERR_NOMEM;
    }
    int32_t status = SE_OK;
    uint64_t looked = 0;
    uint64_t found = 0;
    for (size_t first = 0; first < pages; first += WINDOW_PAGES * sample_every) {
        size_t count = pages - first < WINDOW_PAGES ? pages - first : WINDOW_PAGES;
        if (mincore((char *)map + first * page, count * page, vec) != 0) {
            *sys_errno = errno;
            status = SE_ERR_READ;
            break;
        }
        for (size_t i = 0; i < count; i++) {
            uint64_t bytes = page_overlap(map_begin, first + i, page, begin, end);
            looked += bytes;
            found += (vec[i] & 1) ? bytes : 0;
        }
    }
    if (status == SE_OK) {
        /* Scaled from the windows looked at to the whole range; exact when sample_every is 1. */
        uint64_t bytes =
            looked == *total ? found : (uint64_t)((double)found / (double)looked * (double)*total);
        *resident = bytes > *total ? *total : bytes;
    }
    free(vec);
    munmap(map, map_length);
    return status;
}
