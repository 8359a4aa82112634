/* The page fill: fresh anonymous pages created holding their bytes (userfaultfd UFFDIO_COPY).
 *
 * A page fault on fresh memory zeroes a 4 KiB page that the read then overwrites; UFFDIO_COPY
 * allocates the page, copies into it and maps it, with no fault and no zeroing. Only MISSING
 * mode is used, and UFFD_USER_MODE_ONLY: the kernel never waits on this descriptor, so a
 * kernel access to an unfilled page fails instead of hanging, and no privilege is needed. */
#define _GNU_SOURCE
#include "fill.h"
#include "streamer_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1 /* Linux 5.11; older headers lack it, older kernels refuse it */
#endif

#define PAGE ((size_t)SE_DIRECT_ALIGNMENT)

int32_t se_fill_open(int32_t *fill_fd, int32_t *sys_errno) {
    *fill_fd = -1;
    *sys_errno = 0;
#ifdef SYS_userfaultfd
    int fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY);
    if (fd < 0) {
        *sys_errno = errno;
        return SE_ERR_INVALID;
    }
    struct uffdio_api api = {.api = UFFD_API, .features = 0};
    if (ioctl(fd, UFFDIO_API, &api) != 0) {
        *sys_errno = errno;
        close(fd);
        return SE_ERR_INVALID;
    }
    *fill_fd = fd;
    return SE_OK;
#else
    *sys_errno = ENOSYS;
    return SE_ERR_INVALID;
#endif
}

static int page_range_ok(void *ptr, size_t size) {
    return ptr != NULL && size > 0 && ((uintptr_t)ptr | size) % PAGE == 0;
}

int32_t se_fill_register(int32_t fill_fd, void *ptr, size_t size, int32_t *sys_errno) {
    *sys_errno = 0;
    if (!page_range_ok(ptr, size)) {
        *sys_errno = EINVAL;
        return SE_ERR_INVALID;
    }
    struct uffdio_register reg = {
        .range = {.start = (uintptr_t)ptr, .len = size},
        .mode = UFFDIO_REGISTER_MODE_MISSING,
    };
    if (ioctl(fill_fd, UFFDIO_REGISTER, &reg) != 0) {
        *sys_errno = errno;
        return SE_ERR_INVALID;
    }
    return SE_OK;
}

int32_t se_fill_unregister(int32_t fill_fd, void *ptr, size_t size, int32_t *sys_errno) {
    *sys_errno = 0;
    if (!page_range_ok(ptr, size)) {
        *sys_errno = EINVAL;
        return SE_ERR_INVALID;
    }
    struct uffdio_range range = {.start = (uintptr_t)ptr, .len = size};
    if (ioctl(fill_fd, UFFDIO_UNREGISTER, &range) != 0) {
        *sys_errno = errno;
        return SE_ERR_INVALID;
    }
    return SE_OK;
}

void se_fill_close(int32_t fill_fd) {
    if (fill_fd >= 0) {
        close(fill_fd);
    }
}

int se_fill_place(int fill_fd, char *dst, const char *src, size_t len, int *sys_errno) {
    size_t done = 0;
    while (done < len) {
        struct uffdio_copy copy = {
            .dst = (uintptr_t)(dst + done),
            .src = (uintptr_t)(src + done),
            .len = len - done,
            .mode = 0,
        };
        if (ioctl(fill_fd, UFFDIO_COPY, &copy) == 0) {
            return 0;
        }
        int err = errno;
        if (copy.copy > 0) {
            done += (size_t)copy.copy; /* a partial copy reports EAGAIN: go on from there */
        }
        if (err == EEXIST) {
            /* The page is there already (not a fresh one): a plain store cannot fault. */
            memcpy(dst + done, src + done, PAGE);
            done += PAGE;
        } else if (err != EAGAIN && err != EINTR) {
            *sys_errno = err;
            return -1;
        }
    }
    return 0;
}
