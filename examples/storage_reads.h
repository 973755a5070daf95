/* storage_reads.h - bytes a process has read from storage, for the programs' timing lines and
 * scripts/llama-compare.cpp (C and C++; not part of the runtime). */
#ifndef MOE_EXAMPLES_STORAGE_READS_H
#define MOE_EXAMPLES_STORAGE_READS_H
#include <stdio.h>

/* Bytes this process has read from storage so far (Linux's /proc/self/io read_bytes: reads and
 * page faults on mapped files that went to the disk, not the page cache), or -1 where the system
 * does not say. */
static inline long long storage_read_bytes(void) {
    FILE *f = fopen("/proc/self/io", "r");
    if (!f) return -1;
    long long v = -1;
    char line[128];
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "read_bytes: %lld", &v) == 1) break;
    fclose(f);
    return v;
}
#endif
