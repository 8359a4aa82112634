/* The engine's side of the page fill (fill.c): placing bytes into registered pages. */
#ifndef STREAMER_FILL_H
#define STREAMER_FILL_H

#include <stddef.h>

/* Places len bytes (whole pages) of src at dst, which lies in memory registered with fill_fd.
 * Returns 0, or -1 with *sys_errno set. */
int se_fill_place(int fill_fd, char *dst, const char *src, size_t len, int *sys_errno);

#endif
