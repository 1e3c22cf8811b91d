/* kvdock._native's copy engine (declared in _copy.h): runs of bytes copied on a few threads.
 *
 * - Large copies stream: non-temporal stores (the destination's lines are neither read first nor
 *   cached), the source prefetched a page ahead. The source still passes through the caches: on
 *   our 2-vCPU EPYC VM a 128 MiB copy leaves them as cold whatever the hint (prefetchnta, even
 *   clflushopt of each line read: docs/benchmarks.md).
 * - The threads are kept: a pool of workers, started at the first copy that wants them and woken
 *   per call (a semaphore each), instead of a pthread_create and pthread_join per thread per
 *   call. A forked child never uses its parent's workers (they do not exist there): a
 *   pthread_atfork handler and a pid check make it start its own. A second caller while the pool
 *   is busy (copies from two Python threads at once) starts and joins threads of its own.
 *   The workers stay for the process's life (parked on their semaphore): on Python 3.12+ a later
 *   os.fork() warns that the process is multi-threaded, as after any thread of a library.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* pthread_{get,set}affinity_np */
#endif
#include "_copy.h"

#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* How far ahead of the loads the source is prefetched: a page. The hardware prefetchers stop at
 * 4 KiB pages; asking for the next page early overlaps its TLB walk and first lines with this
 * page's copy (of 0 to 8 KiB ahead, 4 KiB was the fastest or tied in each A/B run). */
#define AHEAD 4096

#if defined(__x86_64__)
/* n: a multiple of 256; pf: prefetch the source AHEAD bytes ahead (all of it lies in the run) */
__attribute__((target("avx2"))) static void stream_avx2(char *d, const char *s, size_t n, int pf) {
    for (size_t i = 0; i < n; i += 256) {
        if (pf)
            for (int k = 0; k < 4; k++) _mm_prefetch(s + i + AHEAD + 64 * k, _MM_HINT_NTA);
#define LD(k) __m256i r##k = _mm256_loadu_si256((const __m256i *)(s + i + 32 * k))
#define ST(k) _mm256_stream_si256((__m256i *)(d + i + 32 * k), r##k)
        LD(0); LD(1); LD(2); LD(3); LD(4); LD(5); LD(6); LD(7);
        ST(0); ST(1); ST(2); ST(3); ST(4); ST(5); ST(6); ST(7);
#undef LD
#undef ST
    }
}

static void stream_sse2(char *d, const char *s, size_t n, int pf) {
    for (size_t i = 0; i < n; i += 256) {
        if (pf)
            for (int k = 0; k < 4; k++) _mm_prefetch(s + i + AHEAD + 64 * k, _MM_HINT_NTA);
        for (int k = 0; k < 256; k += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i + k));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + k + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + k + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + k + 48));
            _mm_stream_si128((__m128i *)(d + i + k), a);
            _mm_stream_si128((__m128i *)(d + i + k + 16), b);
            _mm_stream_si128((__m128i *)(d + i + k + 32), c);
            _mm_stream_si128((__m128i *)(d + i + k + 48), e);
        }
    }
}

static int cpu_avx2, have_avx2; /* what the CPU has, what copies use */
#endif
static int use_pool = 1;

/* n bytes from s to d with streaming stores: a head up to d's 32-byte alignment and a tail under
 * 256 bytes by memcpy, the body streamed, its source prefetched (prefetchnta) AHEAD bytes ahead
 * up to the run's end: never past it (a run of 128 KiB whose next run lies elsewhere would read
 * 3% more for nothing). */
static void copy_stream(char *d, const char *s, size_t n) {
#if defined(__x86_64__)
    size_t head = (32 - ((uintptr_t)d & 31)) & 31;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t body = n & ~(size_t)255;
    size_t ahead = body > AHEAD ? body - AHEAD : 0; /* (a multiple of 256) */
    if (have_avx2) {
        stream_avx2(d, s, ahead, 1);
        stream_avx2(d + ahead, s + ahead, body - ahead, 0);
    } else {
        stream_sse2(d, s, ahead, 1);
        stream_sse2(d + ahead, s + ahead, body - ahead, 0);
    }
    memcpy(d + body, s + body, n - body);
#else
    memcpy(d, s, n);
#endif
}

typedef struct {
    const uint64_t *dst;
    const uint64_t *src;
    uint64_t run;      /* bytes per run */
    uint64_t from, to; /* byte range [from, to) of the concatenated runs */
    int stream;        /* non-temporal stores */
} part_t;

static void copy_part(const part_t *p) {
    uint64_t at = p->from;
    while (at < p->to) {
        uint64_t i = at / p->run, off = at % p->run;
        uint64_t n = p->run - off;
        if (n > p->to - at) n = p->to - at;
        char *d = (char *)(uintptr_t)p->dst[i] + off;
        const char *s = (const char *)(uintptr_t)p->src[i] + off;
        if (p->stream)
            copy_stream(d, s, n);
        else
            memcpy(d, s, n);
        at += n;
    }
#if defined(__x86_64__)
    if (p->stream) _mm_sfence(); /* streaming stores are weakly ordered: done before we return */
#endif
}

static void *copy_thread(void *arg) {
    copy_part((const part_t *)arg);
    return NULL;
}

/* The pool: worker w (1 .. started-1) waits on go[w] for parts[w], posts done when it is copied.
 * pool_mu is held by the one caller using it for a whole call (trylock: others start threads). */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static sem_t go[KVDOCK_MAX_THREADS], done;
static const part_t *job[KVDOCK_MAX_THREADS];
static int started = 1; /* workers 1 .. started-1 exist in this process */
static pid_t pool_pid;
#if defined(__linux__)
static pthread_t tid_of[KVDOCK_MAX_THREADS];
static cpu_set_t pool_cpus; /* the CPUs the workers may run on: their last caller's */
#endif

static void *worker(void *arg) {
    int w = (int)(intptr_t)arg;
    for (;;) {
        while (sem_wait(&go[w]) != 0) {
        } /* EINTR */
        copy_part(job[w]);
        sem_post(&done);
    }
    return NULL;
}

static void forget_workers(void) { /* in a forked child: the workers stayed in the parent */
    pthread_mutex_init(&pool_mu, NULL);
    started = 1;
    pool_pid = 0;
}

/* Workers 1 .. want-1, started as needed with every signal but a fault blocked (signals are the main
 * thread's); how many exist after (fewer if the system refuses threads). Holds pool_mu. */
static int grow(int want) {
    if (pool_pid != getpid()) {
        started = 1, pool_pid = getpid();
        sem_init(&done, 0, 0);
    }
#if defined(__linux__)
    /* the workers run where the caller may (review R-NAT): they inherited the affinity of the
     * caller that started them; one syscall a call, a re-pin only when it differs */
    cpu_set_t mine;
    if (pthread_getaffinity_np(pthread_self(), sizeof mine, &mine) == 0 && !CPU_EQUAL(&mine, &pool_cpus)) {
        for (int w = 1; w < started; w++) pthread_setaffinity_np(tid_of[w], sizeof mine, &mine);
        pool_cpus = mine;
    }
#endif
    if (started >= want) return started;
    sigset_t all, old;
    sigfillset(&all);
    /* faults stay deliverable (review R-NAT): a fault in a worker's part (a copy into a read-only
     * mapping) is reported by faulthandler as on any thread, not a silent kill */
    static const int faults[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT};
    for (size_t k = 0; k < sizeof faults / sizeof *faults; k++) sigdelset(&all, faults[k]);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 << 10); /* a copy needs little; >= PTHREAD_STACK_MIN everywhere */
    for (; started < want; started++) {
        pthread_t tid;
        sem_init(&go[started], 0, 0);
        if (pthread_create(&tid, &attr, worker, (void *)(intptr_t)started) != 0) break;
#if defined(__linux__)
        tid_of[started] = tid;
#endif
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return started;
}

void kvdock_copy_runs(const uint64_t *dst, const uint64_t *src, uint64_t count, uint64_t run, int threads,
                      uint64_t min_part, uint64_t stream_min) {
    uint64_t total = count * run;
    if (total == 0) return;
    uint64_t want = min_part ? total / min_part : (uint64_t)threads;
    if (want < 1) want = 1;
    if (want < (uint64_t)threads) threads = (int)want;
    if (threads < 1) threads = 1;
    if (threads > KVDOCK_MAX_THREADS) threads = KVDOCK_MAX_THREADS;
    part_t parts[KVDOCK_MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        /* cut the concatenated runs at multiples of 4 KiB: a run that starts page-aligned (as
         * slots and large tensors do) is split at page boundaries, not mid cache line */
        uint64_t from = total / threads * t, to = t + 1 == threads ? total : total / threads * (t + 1);
        parts[t] = (part_t){dst, src, run, from & ~(uint64_t)4095, t + 1 == threads ? to : to & ~(uint64_t)4095,
                            total >= stream_min};
        if (t) parts[t].from = parts[t - 1].to;
    }
    if (threads == 1) {
        copy_part(&parts[0]);
        return;
    }
    if (use_pool && pthread_mutex_trylock(&pool_mu) == 0) {
        int have = grow(threads);
        for (int t = 1; t < have && t < threads; t++) {
            job[t] = &parts[t];
            sem_post(&go[t]);
        }
        copy_part(&parts[0]);
        for (int t = have; t < threads; t++) copy_part(&parts[t]); /* no worker to be had: here */
        for (int t = 1; t < have && t < threads; t++)
            while (sem_wait(&done) != 0) {
            }
        pthread_mutex_unlock(&pool_mu);
        return;
    }
    pthread_t tids[KVDOCK_MAX_THREADS];
    int ok[KVDOCK_MAX_THREADS];
    for (int t = 1; t < threads; t++) ok[t] = pthread_create(&tids[t], NULL, copy_thread, &parts[t]) == 0;
    copy_part(&parts[0]);
    for (int t = 1; t < threads; t++) {
        if (ok[t])
            pthread_join(tids[t], NULL);
        else
            copy_part(&parts[t]); /* no thread to be had: do it here */
    }
}

void kvdock_copy_init(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_avx2 = cpu_avx2 = __builtin_cpu_supports("avx2");
#endif
    pthread_atfork(NULL, NULL, forget_workers);
}

void kvdock_copy_mode(int *pool, int *avx2) {
    int was_pool = use_pool, was_avx2 = 0;
    if (*pool >= 0) use_pool = *pool;
#if defined(__x86_64__)
    was_avx2 = have_avx2;
    if (*avx2 >= 0) have_avx2 = *avx2 && cpu_avx2;
#endif
    *pool = was_pool, *avx2 = was_avx2;
}
