/* kvdock._native's copy engine (_copy.c), called by _native.c. */
#ifndef KVDOCK_COPY_H
#define KVDOCK_COPY_H
#include <stdint.h>

#define KVDOCK_MAX_THREADS 64

/* Copy runs[i] for all i on up to `threads` threads (fewer when a thread would get less than
 * `min_part` bytes), with streaming stores if there are `stream_min` bytes or more in all. The
 * calling thread does the first part; kept workers the others. */
void kvdock_copy_runs(const uint64_t *dst, const uint64_t *src, uint64_t count, uint64_t run, int threads,
                      uint64_t min_part, uint64_t stream_min);

/* Once, when the module is loaded: CPU features, the fork handler. */
void kvdock_copy_init(void);

/* For tests and A/B: whether copies on several threads use the kept workers (else a thread per
 * part, started and joined per call) and AVX2 (else SSE2, as on a CPU without it); -1 leaves one
 * as it is. Both are set to what they were. */
void kvdock_copy_mode(int *pool, int *avx2);
#endif
