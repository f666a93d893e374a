/*
 * kvx._native: batched copies for kvx (memcpy between mapped memory, CMA between processes,
 * positional vectored file I/O), run with the GIL released on a small pthread pool.
 *
 * One entry point builds a job from descriptor arrays and index lists (bounds and lengths are
 * checked here, so Python never loops over descriptors), optionally guards it with the
 * target's published region generations, then runs it inline (small jobs) or on the pool.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "kvx_buf.h"
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sched.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

/* posts of at most this many descriptors build their job on the stack */
#define SMALL_N 16

/* jobs at least this large use non-temporal stores */
#define STREAM_MIN (4u << 20)

/* OP_MMWRITE: memory -> a file through its shared mapping (dst = mapped address, fd = the file's
 * descriptor, kept for sync) */
enum { OP_MEMCPY = 0, OP_CMA_WRITE = 1, OP_CMA_READ = 2, OP_PWRITE = 3, OP_PREAD = 4, OP_MMWRITE = 5 };

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

typedef struct {
    uint64_t dst, src, len; /* for file ops: dst/src is the file offset on the file side */
    int64_t fd;             /* file ops only */
    uint64_t off;           /* OP_MMWRITE with dst_off: the file offset of dst (for the pwritev fallback) */
} triplet_t;

typedef struct {
    _Atomic uint64_t *state;
    uint64_t expected;
    _Atomic uint32_t *inflight;
} guard_t;

typedef struct job_s {
    int op;
    pid_t pid;
    triplet_t *t;
    size_t nt;
    uint64_t nbytes;
    guard_t *g;
    size_t ng;
    int sync; /* 0 none, 1 fdatasync, 2 fsync after file writes */
    int has_off; /* OP_MMWRITE: t[].off is set, runs not in the page cache may go through pwritev */
    /* completion */
    _Atomic int pending;
    _Atomic int err;
    _Atomic int cancelled;
    int done;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic int refs; /* python object + each pending chunk */
} job_t;

typedef struct chunk_s {
    job_t *job;
    size_t lo, hi;
    struct chunk_s *next;
} chunk_t;

/* ------------------------------------------------------------------------------------------ */
/* pool */

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static chunk_t *q_head = NULL, *q_tail = NULL;
static int pool_threads = 0;

static void job_release(job_t *j) {
    if (atomic_fetch_sub(&j->refs, 1) == 1) {
        free(j->t);
        free(j->g);
        pthread_mutex_destroy(&j->mu);
        pthread_cond_destroy(&j->cv);
        free(j);
    }
}

#if defined(__x86_64__)
/* 64-byte non-temporal stores (measured ~12% faster than 16-byte ones where AVX-512 exists) */
__attribute__((target("avx512f"))) static size_t copy_stream512(char *d, const char *s, size_t n) {
    size_t blocks = n / 256;
    for (size_t i = 0; i < blocks; i++) {
        __m512i a = _mm512_loadu_si512((const void *)(s + 0));
        __m512i b = _mm512_loadu_si512((const void *)(s + 64));
        __m512i c = _mm512_loadu_si512((const void *)(s + 128));
        __m512i e = _mm512_loadu_si512((const void *)(s + 192));
        _mm512_stream_si512((void *)(d + 0), a);
        _mm512_stream_si512((void *)(d + 64), b);
        _mm512_stream_si512((void *)(d + 128), c);
        _mm512_stream_si512((void *)(d + 192), e);
        s += 256; d += 256;
    }
    return blocks * 256;
}

static int have_avx512 = -1;
#endif

/* Copy with non-temporal stores: large copies do not pull the destination into the cache
 * (no read-for-ownership), which is what makes a plain memcpy of many MiB fast. */
static void copy_stream(void *dst, const void *src, size_t n) {
#if defined(__x86_64__)
    char *d = (char *)dst;
    const char *s = (const char *)src;
    if (n < 4096) { memcpy(d, s, n); return; }
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (head) { memcpy(d, s, head); d += head; s += head; n -= head; }
    if (have_avx512 < 0) have_avx512 = __builtin_cpu_supports("avx512f") ? 1 : 0;
    if (have_avx512) {
        size_t done = copy_stream512(d, s, n);
        d += done; s += done; n -= done;
    }
    size_t blocks = n / 64;
    if (((uintptr_t)s & 15) == 0) {
        for (size_t i = 0; i < blocks; i++) {
            __m128i a = _mm_load_si128((const __m128i *)(s + 0));
            __m128i b = _mm_load_si128((const __m128i *)(s + 16));
            __m128i c = _mm_load_si128((const __m128i *)(s + 32));
            __m128i e = _mm_load_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)(d + 0), a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
            s += 64; d += 64;
        }
    } else {
        for (size_t i = 0; i < blocks; i++) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + 0));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)(d + 0), a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
            s += 64; d += 64;
        }
    }
    n -= blocks * 64;
    if (n) memcpy(d, s, n);
#else
    memcpy(dst, src, n);
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* OP_MMWRITE: copies into a shared file mapping, with MADV_POPULATE_WRITE ahead of the copy and a
 * SIGBUS guard around it.
 *
 * Per run of adjacent destinations (same file, at most MM_RUN_MAX bytes): if a page of the run is
 * not in the page cache (mincore) and the file has data on disk there (lseek SEEK_DATA), the run
 * goes through pwritev instead -- a write fault must first read such a page from the disk, which
 * pwrite of a whole page never does (measured: 2x slower than pwritev). Pages never written
 * (preallocated, unwritten extents) fault in as zeros without I/O, and cached ones at no cost,
 * so those runs take the mapping: madvise(MADV_POPULATE_WRITE) faults the run in writable, and
 * the copy runs with no fault in the common case.
 *
 * A store into a MAP_SHARED page the file no longer backs (truncated, or a punched hole the
 * filesystem cannot fill: disk full) raises SIGBUS. The populate turns that into EFAULT (and
 * ENOMEM/EIO/... into themselves); what can still race it (a truncate between the populate and
 * the copy, or a kernel without MADV_POPULATE_WRITE) is caught by the guard: a per-thread
 * sigjmp_buf that the process-wide SIGBUS handler jumps to while the thread is inside a guarded
 * copy. Any other SIGBUS goes to the handler installed before (e.g. Python's faulthandler) or to
 * the default action. */

/* populate at most this many bytes ahead of the copy (one madvise per run of adjacent blocks) */
#define MM_RUN_MAX (4u << 20)
/* mm_flags bits (all on by default; tests turn them off to reach the fault paths) */
#define MM_POPULATE 1 /* madvise(MADV_POPULATE_WRITE) before the copy */
#define MM_RESIDENT 2 /* runs not in the page cache, with data on disk, go through pwritev (needs dst_off) */

/* initial-exec: read in the signal handler, where a first touch through __tls_get_addr could allocate */
static __thread __attribute__((tls_model("initial-exec"))) sigjmp_buf *volatile mm_jb = NULL;
static struct sigaction mm_prev;
static pthread_once_t mm_once = PTHREAD_ONCE_INIT;
static int mm_install_err = 0;
static _Atomic int mm_flags = MM_POPULATE | MM_RESIDENT;
static _Atomic int mm_no_populate = 0; /* the kernel lacks MADV_POPULATE_WRITE (< 5.14) */
static uintptr_t mm_page = 4096;

static void mm_sigbus(int sig, siginfo_t *si, void *uc) {
    sigjmp_buf *jb = mm_jb;
    /* a fault inside a guarded copy -- or the same fault re-sent with raise() by a handler that
     * was installed over ours and ran first (faulthandler.enable() after kvx's first mapped write
     * dumps a traceback, puts ours back and re-raises); not a kill from another process */
    if (jb && si && (si->si_code > 0 || (si->si_code == SI_TKILL && si->si_pid == getpid()))) {
        mm_jb = NULL;
        siglongjmp(*jb, 1);
    }
    if (mm_prev.sa_flags & SA_SIGINFO) {
        if (mm_prev.sa_sigaction) { mm_prev.sa_sigaction(sig, si, uc); return; }
    } else if (mm_prev.sa_handler != SIG_DFL && mm_prev.sa_handler != SIG_IGN) {
        mm_prev.sa_handler(sig);
        return;
    }
    /* the default action: restore it and let the signal take the process down */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    raise(sig); /* delivered when this handler returns (SIGBUS is blocked in it); a fault re-faults */
}

static void mm_install_once(void) {
    long ps = sysconf(_SC_PAGESIZE);
    if (ps > 0) mm_page = (uintptr_t)ps;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = mm_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &mm_prev) != 0) mm_install_err = errno ? errno : EINVAL;
}

/* Install the SIGBUS handler (once per process, lazily: it chains to whatever was there). */
static int mm_install(void) {
    pthread_once(&mm_once, mm_install_once);
    return mm_install_err;
}

/* The first page of [a, b) (page-aligned, mapped) that is not in the page cache, or b. */
static uintptr_t mm_first_missing(uintptr_t a, uintptr_t b) {
    unsigned char vec[1024];
    while (a < b) {
        size_t np = (b - a) / mm_page;
        if (np > sizeof vec) np = sizeof vec;
        if (mincore((void *)a, np * mm_page, vec) != 0) return a; /* cannot tell: as if missing */
        for (size_t k = 0; k < np; k++)
            if (!(vec[k] & 1)) return a + k * mm_page;
        a += np * mm_page;
    }
    return b;
}

/* Whether the file may have data on disk in [from, to): what a write fault there would read.
 * Preallocated never-written (unwritten) extents, holes and what lies past EOF have none. */
static int mm_has_data(int fd, uint64_t from, uint64_t to) {
    off_t d = lseek(fd, (off_t)from, SEEK_DATA);
    if (d < 0) return errno != ENXIO; /* ENXIO: only a hole (or EOF) from there on; else cannot tell */
    return (uint64_t)d < to;
}

/* pwritev (write) / preadv all `want` bytes of the nv iovecs at v, from file offset off, resuming
 * after short transfers; 0 or an errno (EIO for a write that makes no progress, ENODATA for a read
 * past the end of the file). The iovecs are consumed. */
static int rw_all(int fd, struct iovec *v, int nv, uint64_t off, uint64_t want, int is_write) {
    uint64_t doneb = 0;
    while (doneb < want) {
        ssize_t r = is_write ? pwritev(fd, v, nv, (off_t)(off + doneb)) : preadv(fd, v, nv, (off_t)(off + doneb));
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) return is_write ? EIO : ENODATA; /* short file */
        doneb += (uint64_t)r;
        size_t rr = (size_t)r;
        while (nv > 0 && rr >= v->iov_len) { rr -= v->iov_len; v++; nv--; }
        if (nv > 0 && rr) { v->iov_base = (char *)v->iov_base + rr; v->iov_len -= rr; }
    }
    return 0;
}

/* pwritev descriptors [i, k) of an OP_MMWRITE job: adjacent in one file, from t[i].off on. */
static int mm_pwrite_run(job_t *j, size_t i, size_t k) {
    triplet_t *t = j->t;
    struct iovec iov[IOV_MAX];
    int fd = (int)t[i].fd;
    while (i < k) {
        if (atomic_load_explicit(&j->cancelled, memory_order_relaxed)) return ECANCELED;
        uint64_t off = t[i].off, want = 0;
        size_t n = 0;
        while (i + n < k && n < IOV_MAX) {
            iov[n].iov_base = (void *)(uintptr_t)t[i + n].src;
            iov[n].iov_len = t[i + n].len;
            want += t[i + n].len;
            n++;
        }
        int e = rw_all(fd, iov, (int)n, off, want, 1);
        if (e) return e;
        i += n;
    }
    return 0;
}

static __attribute__((noinline)) int mmwrite_range(job_t *j, size_t lo, size_t hi) {
    triplet_t *t = j->t;
    const int stream = j->nbytes >= STREAM_MIN;
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0)) {
        /* SIGBUS in the copy: the handler left SIGBUS blocked (no mask saved: cheaper) */
        sigset_t s;
        sigemptyset(&s);
        sigaddset(&s, SIGBUS);
        pthread_sigmask(SIG_UNBLOCK, &s, NULL);
#if defined(__x86_64__)
        _mm_sfence();
#endif
        return EFAULT;
    }
    int e = 0;
    size_t i = lo;
    mm_jb = &jb;
    atomic_signal_fence(memory_order_seq_cst);
    while (i < hi) {
        if (atomic_load_explicit(&j->cancelled, memory_order_relaxed)) { e = ECANCELED; break; }
        /* a run of adjacent destinations in one file (blocks arrive sorted by file offset), capped */
        uint64_t start = t[i].dst, end = start + t[i].len;
        size_t k = i + 1;
        while (k < hi && t[k].dst == end && t[k].fd == t[i].fd && end - start < MM_RUN_MAX) end += t[k++].len;
        if (end == start) { i = k; continue; }
        int flags = atomic_load_explicit(&mm_flags, memory_order_relaxed);
        uintptr_t a = (uintptr_t)start & ~(mm_page - 1);
        uintptr_t b = ((uintptr_t)end + mm_page - 1) & ~(mm_page - 1);
        uintptr_t miss = (j->has_off && (flags & MM_RESIDENT)) ? mm_first_missing(a, b) : b;
        /* from the first page not cached (its file offset: the mapping starts at offset 0 and at a
         * page boundary, so mapped address - start = file offset - t[i].off, modulo 2^64) */
        if (miss < b && mm_has_data((int)t[i].fd, t[i].off + (uint64_t)(miss - (uintptr_t)start),
                                    t[i].off + (end - start))) {
            e = mm_pwrite_run(j, i, k);
            if (e) goto out;
            i = k;
            continue;
        }
        if ((flags & MM_POPULATE) && !atomic_load_explicit(&mm_no_populate, memory_order_relaxed)) {
            while (madvise((void *)a, b - a, MADV_POPULATE_WRITE) != 0) {
                int er = errno;
                if (er == EINTR || er == EAGAIN) continue;
                if (er == EINVAL || er == ENOSYS) { /* the kernel lacks it (< 5.14): copy under the guard only */
                    atomic_store_explicit(&mm_no_populate, 1, memory_order_relaxed);
                    break;
                }
                e = er; /* EFAULT: beyond EOF or a hole that cannot be filled; ENOMEM; EIO; ... */
                goto out;
            }
        }
        for (; i < k; i++) {
            if (stream) copy_stream((void *)(uintptr_t)t[i].dst, (const void *)(uintptr_t)t[i].src, t[i].len);
            else memcpy((void *)(uintptr_t)t[i].dst, (const void *)(uintptr_t)t[i].src, t[i].len);
        }
    }
out:
    atomic_signal_fence(memory_order_seq_cst);
    mm_jb = NULL;
#if defined(__x86_64__)
    if (stream) _mm_sfence();
#endif
    return e;
}

static int run_range(job_t *j, size_t lo, size_t hi) {
    triplet_t *t = j->t;
    switch (j->op) {
    case OP_MMWRITE:
        return mmwrite_range(j, lo, hi);
    case OP_MEMCPY:
        if (j->nbytes >= STREAM_MIN) {
            for (size_t i = lo; i < hi; i++) {
                if ((i & 255) == 0 && atomic_load_explicit(&j->cancelled, memory_order_relaxed)) return ECANCELED;
#if defined(__x86_64__)
                if (i + 1 < hi) { /* warm the TLB and first lines of the next block */
                    _mm_prefetch((const char *)(uintptr_t)t[i + 1].src, _MM_HINT_T0);
                    _mm_prefetch((const char *)(uintptr_t)t[i + 1].src + 64, _MM_HINT_T0);
                }
#endif
                copy_stream((void *)(uintptr_t)t[i].dst, (const void *)(uintptr_t)t[i].src, t[i].len);
            }
#if defined(__x86_64__)
            _mm_sfence();
#endif
            return 0;
        }
        for (size_t i = lo; i < hi; i++) {
            if ((i & 255) == 0 && atomic_load_explicit(&j->cancelled, memory_order_relaxed)) return ECANCELED;
            memcpy((void *)(uintptr_t)t[i].dst, (const void *)(uintptr_t)t[i].src, t[i].len);
        }
        return 0;
    case OP_CMA_WRITE:
    case OP_CMA_READ: {
        struct iovec liov[IOV_MAX], riov[IOV_MAX];
        size_t i = lo;
        while (i < hi) {
            if (atomic_load_explicit(&j->cancelled, memory_order_relaxed)) return ECANCELED;
            size_t n = hi - i;
            if (n > IOV_MAX) n = IOV_MAX;
            ssize_t want = 0;
            for (size_t k = 0; k < n; k++) {
                triplet_t *x = &t[i + k];
                if (j->op == OP_CMA_WRITE) {
                    liov[k].iov_base = (void *)(uintptr_t)x->src;
                    riov[k].iov_base = (void *)(uintptr_t)x->dst;
                } else {
                    liov[k].iov_base = (void *)(uintptr_t)x->dst;
                    riov[k].iov_base = (void *)(uintptr_t)x->src;
                }
                liov[k].iov_len = riov[k].iov_len = x->len;
                want += (ssize_t)x->len;
            }
            ssize_t got = j->op == OP_CMA_WRITE ? process_vm_writev(j->pid, liov, n, riov, n, 0)
                                               : process_vm_readv(j->pid, liov, n, riov, n, 0);
            if (got < 0) return errno ? errno : EIO;
            if (got != want) {
                /* partial: retry the rest one descriptor at a time to find the fault */
                ssize_t acc = 0;
                size_t k = 0;
                while (k < n && acc + (ssize_t)t[i + k].len <= got) acc += (ssize_t)t[i + k++].len;
                if (k == 0) return EFAULT;
                i += k;
                continue;
            }
            i += n;
        }
        return 0;
    }
    case OP_PWRITE:
    case OP_PREAD: {
        /* coalesce runs where both the file offsets and memory addresses are adjacent */
        struct iovec iov[IOV_MAX];
        size_t i = lo;
        while (i < hi) {
            if (atomic_load_explicit(&j->cancelled, memory_order_relaxed)) return ECANCELED;
            int64_t fd = t[i].fd;
            uint64_t off = j->op == OP_PWRITE ? t[i].dst : t[i].src;
            size_t n = 0;
            uint64_t want = 0;
            while (i + n < hi && n < IOV_MAX) {
                triplet_t *x = &t[i + n];
                uint64_t xo = j->op == OP_PWRITE ? x->dst : x->src;
                if (x->fd != fd || xo != off + want) break;
                iov[n].iov_base = (void *)(uintptr_t)(j->op == OP_PWRITE ? x->src : x->dst);
                iov[n].iov_len = x->len;
                want += x->len;
                n++;
            }
            int e = rw_all((int)fd, iov, (int)n, off, want, j->op == OP_PWRITE);
            if (e) return e;
            i += n;
        }
        return 0;
    }
    }
    return EINVAL;
}

static void guards_exit(job_t *j) {
    for (size_t k = 0; k < j->ng; k++) atomic_fetch_sub(j->g[k].inflight, 1);
}

static int guards_enter(guard_t *g, size_t ng) {
    for (size_t k = 0; k < ng; k++) {
        atomic_fetch_add(g[k].inflight, 1);
        if (atomic_load(g[k].state) != g[k].expected) {
            for (size_t m = 0; m <= k; m++) atomic_fetch_sub(g[m].inflight, 1);
            return ESTALE;
        }
    }
    return 0;
}

static void sync_fds(job_t *j) {
    if (!j->sync || (j->op != OP_PWRITE && j->op != OP_MMWRITE)) return;
    int64_t last = -1;
    for (size_t i = 0; i < j->nt; i++) {
        if (j->t[i].fd == last) continue;
        last = j->t[i].fd;
        int r = j->sync == 1 ? fdatasync((int)last) : fsync((int)last);
        if (r < 0) { int e = errno; int z = 0; atomic_compare_exchange_strong(&j->err, &z, e); }
    }
}

static void chunk_finish(job_t *j, int e) {
    if (e) {
        int z = 0;
        atomic_compare_exchange_strong(&j->err, &z, e);
    }
    if (atomic_fetch_sub(&j->pending, 1) == 1) {
        if (!atomic_load(&j->err)) sync_fds(j);
        guards_exit(j);
        pthread_mutex_lock(&j->mu);
        j->done = 1;
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
    }
    job_release(j);
}

static void *worker(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&pool_mu);
        while (!q_head) pthread_cond_wait(&pool_cv, &pool_mu);
        chunk_t *c = q_head;
        q_head = c->next;
        if (!q_head) q_tail = NULL;
        pthread_mutex_unlock(&pool_mu);
        int e = atomic_load(&c->job->cancelled) ? ECANCELED : run_range(c->job, c->lo, c->hi);
        chunk_finish(c->job, e);
        free(c);
    }
    return NULL;
}

/* Thread pools and fork: a forked child has none of a pool's threads, and the pool's condition
 * variable still counts them as waiters (signalling it in the child lost the wake-up: the next pooled
 * copy hung). Each pool holds its mutex across fork() (no thread of it is inside) and the child starts
 * from a fresh mutex and condition variable (sync_reset) and no threads. */
static void sync_reset(pthread_mutex_t *mu, pthread_cond_t *cv) {
    static const pthread_mutex_t m0 = PTHREAD_MUTEX_INITIALIZER;
    static const pthread_cond_t c0 = PTHREAD_COND_INITIALIZER;
    memcpy(mu, &m0, sizeof m0);
    if (cv) memcpy(cv, &c0, sizeof c0);
}

/* start a detached thread running fn; 0 or the pthread_create error */
static int spawn_detached(void *(*fn)(void *)) {
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    const int r = pthread_create(&th, &at, fn, NULL);
    pthread_attr_destroy(&at);
    return r;
}

static void pool_atfork_prepare(void) { pthread_mutex_lock(&pool_mu); }
static void pool_atfork_parent(void) { pthread_mutex_unlock(&pool_mu); }
static void pool_atfork_child(void) { /* copies in flight in the parent are not the child's */
    sync_reset(&pool_mu, &pool_cv);
    pool_threads = 0;
    q_head = q_tail = NULL;
}
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_register_atfork(void) { pthread_atfork(pool_atfork_prepare, pool_atfork_parent, pool_atfork_child); }

static int pool_ensure(int n) {
    pthread_once(&pool_once, pool_register_atfork);
    pthread_mutex_lock(&pool_mu);
    while (pool_threads < n) {
        const int r = spawn_detached(worker);
        if (r) { pthread_mutex_unlock(&pool_mu); return r; }
        pool_threads++;
    }
    pthread_mutex_unlock(&pool_mu);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Python side */

typedef struct {
    PyObject_HEAD
    job_t *job;
} JobObject;

static PyTypeObject JobType;

static PyObject *raise_errno(int e) {
    errno = e;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *Job_test(JobObject *self, PyObject *unused) {
    (void)unused;
    job_t *j = self->job;
    pthread_mutex_lock(&j->mu);
    int d = j->done;
    pthread_mutex_unlock(&j->mu);
    if (!d) Py_RETURN_FALSE;
    int e = atomic_load(&j->err);
    if (e) return raise_errno(e);
    Py_RETURN_TRUE;
}

static PyObject *Job_wait(JobObject *self, PyObject *arg) {
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    job_t *j = self->job;
    int d;
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (timeout < 0) timeout = 0;
    time_t sec = (time_t)timeout;
    long nsec = (long)((timeout - (double)sec) * 1e9);
    ts.tv_sec += sec;
    ts.tv_nsec += nsec;
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    pthread_mutex_lock(&j->mu);
    while (!j->done) {
        if (pthread_cond_timedwait(&j->cv, &j->mu, &ts) == ETIMEDOUT) break;
    }
    d = j->done;
    pthread_mutex_unlock(&j->mu);
    Py_END_ALLOW_THREADS
    if (!d) Py_RETURN_FALSE;
    int e = atomic_load(&j->err);
    if (e) return raise_errno(e);
    Py_RETURN_TRUE;
}

static PyObject *Job_cancel(JobObject *self, PyObject *unused) {
    (void)unused;
    atomic_store(&self->job->cancelled, 1);
    Py_RETURN_NONE;
}

static PyObject *Job_get_nbytes(JobObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLongLong(self->job->nbytes);
}

static void Job_dealloc(JobObject *self) {
    if (self->job) {
        atomic_store(&self->job->cancelled, 1);
        job_release(self->job);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Job_methods[] = {
    {"test", (PyCFunction)Job_test, METH_NOARGS, "True when finished; raises OSError on failure."},
    {"wait", (PyCFunction)Job_wait, METH_O, "wait(timeout) -> bool; raises OSError on failure."},
    {"cancel", (PyCFunction)Job_cancel, METH_NOARGS, "Stop remaining work; the job ends with ECANCELED."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Job_getset[] = {{"nbytes", (getter)Job_get_nbytes, NULL, "bytes moved", NULL},
                                   {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvx._native.Job",
    .tp_basicsize = sizeof(JobObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Job_dealloc,
    .tp_methods = Job_methods,
    .tp_getset = Job_getset,
    .tp_doc = "A batched copy running on the native pool.",
};

static void job_free(job_t *j) {
    free(j->t); free(j->g); pthread_mutex_destroy(&j->mu); pthread_cond_destroy(&j->cv); free(j);
}

/* Run a job in the calling thread (guards already entered): GIL released for large ones,
 * file sync if asked, guards exited. Returns 0 or an errno. */
static int run_inline(job_t *j) {
    PyThreadState *ts = j->nbytes >= 65536 ? PyEval_SaveThread() : NULL;
    int e = run_range(j, 0, j->nt);
    if (ts) PyEval_RestoreThread(ts);
    if (!e) { atomic_store(&j->err, 0); sync_fds(j); e = atomic_load(&j->err); }
    guards_exit(j);
    return e;
}

/* Run a built job: inline (returns the byte count) or on the pool (returns a Job).
 * With owned=1 the job is consumed; with owned=0 (a plan's template) only inline runs are
 * allowed to use it directly and async runs work on a copy. */
static PyObject *job_start(job_t *j, int nthreads, unsigned long long inline_bytes, int owned) {
    uint64_t total = j->nbytes;
    int ge = guards_enter(j->g, j->ng);
    if (ge) {
        if (owned) job_free(j);
        return raise_errno(ge);
    }
    if (total <= inline_bytes) {
        int e = run_inline(j);
        if (owned) job_free(j);
        if (e) return raise_errno(e);
        return PyLong_FromUnsignedLongLong(total);
    }
    if (!owned) { /* copy the template */
        job_t *c = calloc(1, sizeof(job_t));
        if (!c) { guards_exit(j); return PyErr_NoMemory(); }
        *c = *j;
        c->t = malloc((j->nt ? j->nt : 1) * sizeof(triplet_t));
        c->g = malloc((j->ng ? j->ng : 1) * sizeof(guard_t));
        if (!c->t || !c->g) { free(c->t); free(c->g); free(c); guards_exit(j); return PyErr_NoMemory(); }
        memcpy(c->t, j->t, j->nt * sizeof(triplet_t));
        memcpy(c->g, j->g, j->ng * sizeof(guard_t));
        atomic_store(&c->pending, 0); atomic_store(&c->err, 0); atomic_store(&c->cancelled, 0); c->done = 0;
        pthread_mutex_init(&c->mu, NULL);
        pthread_cond_init(&c->cv, NULL);
        j = c; /* the guards entered above are now the copy's to exit */
    }
    /* split into chunks balanced by bytes */
    if (nthreads < 1) nthreads = 1;
    if ((j->op == OP_MEMCPY || j->op == OP_MMWRITE) && j->nt < (size_t)nthreads * 4) {
        /* few large descriptors: cut them into 1 MiB pieces so every thread gets work */
        size_t extra = 0;
        const uint64_t piece = 1 << 20;
        for (size_t i = 0; i < j->nt; i++) extra += j->t[i].len > piece ? (j->t[i].len - 1) / piece : 0;
        if (extra) {
            triplet_t *nt = malloc((j->nt + extra) * sizeof(triplet_t));
            if (!nt) { guards_exit(j); job_free(j); return PyErr_NoMemory(); }
            size_t m = 0;
            for (size_t i = 0; i < j->nt; i++) {
                uint64_t off = 0;
                while (off < j->t[i].len) {
                    uint64_t l = j->t[i].len - off < piece ? j->t[i].len - off : piece;
                    nt[m].dst = j->t[i].dst + off; nt[m].src = j->t[i].src + off; nt[m].len = l;
                    nt[m].fd = j->t[i].fd; nt[m].off = j->t[i].off + off;
                    m++; off += l;
                }
            }
            free(j->t);
            j->t = nt;
            j->nt = m;
        }
    }
    int nch = nthreads;
    if ((size_t)nch > j->nt) nch = (int)j->nt;
    if (nch < 1) nch = 1;
    if (pool_ensure(nthreads) != 0) {
        guards_exit(j); job_free(j);
        PyErr_SetString(PyExc_OSError, "cannot start copy threads");
        return NULL;
    }
    JobObject *jo = PyObject_New(JobObject, &JobType);
    if (!jo) { guards_exit(j); job_free(j); return NULL; }
    jo->job = j;
    atomic_store(&j->refs, 1 + nch);
    atomic_store(&j->pending, nch);
    uint64_t per = total / (uint64_t)nch + 1, acc = 0;
    size_t lo = 0;
    chunk_t *first = NULL, *last = NULL;
    for (int c = 0; c < nch; c++) {
        size_t hi = lo;
        if (c == nch - 1) hi = j->nt;
        else {
            uint64_t lim = per * (uint64_t)(c + 1);
            while (hi < j->nt && (acc < lim || hi == lo)) acc += j->t[hi++].len;
            /* keep at least one triplet for each remaining chunk */
            size_t remain = (size_t)(nch - c - 1);
            if (j->nt - hi < remain) hi = j->nt - remain;
        }
        chunk_t *ch = malloc(sizeof(chunk_t));
        ch->job = j; ch->lo = lo; ch->hi = hi; ch->next = NULL;
        if (last) last->next = ch; else first = ch;
        last = ch;
        lo = hi;
    }
    pthread_mutex_lock(&pool_mu);
    if (q_tail) q_tail->next = first; else q_head = first;
    q_tail = last;
    pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
    return (PyObject *)jo;
}


/* ------------------------------------------------------------------------------------------ */
/* Plan: a built job kept as a template and posted many times (no per-post descriptor work). */

typedef struct {
    PyObject_HEAD
    job_t *tpl;
    int nthreads;
    unsigned long long inline_bytes;
} PlanObject;

static PyObject *Plan_start(PlanObject *self, PyObject *unused) {
    (void)unused;
    return job_start(self->tpl, self->nthreads, self->inline_bytes, 0);
}

static PyObject *Plan_get_nbytes(PlanObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLongLong(self->tpl->nbytes);
}

static void Plan_dealloc(PlanObject *self) {
    if (self->tpl) job_free(self->tpl);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Plan_methods[] = {
    {"start", (PyCFunction)Plan_start, METH_NOARGS, "Post once: returns the byte count (ran inline) or a Job."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Plan_getset[] = {{"nbytes", (getter)Plan_get_nbytes, NULL, "bytes per post", NULL},
                                    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvx._native.Plan",
    .tp_basicsize = sizeof(PlanObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Plan_dealloc,
    .tp_methods = Plan_methods,
    .tp_getset = Plan_getset,
    .tp_doc = "A prepared batched copy, posted with start().",
};

/* index source: a list/tuple of ints, an int, or a contiguous int64/uint64 buffer */
typedef struct {
    PyObject *seq;
    Py_buffer buf;
    int has_buf;
    long long scalar;
    int is_scalar;
    Py_ssize_t n;
} idx_t;

/* The integer width of a buffer opened with PyBUF_FORMAT: 4 or 8 (*is_signed set), or 0 for anything
 * else (other sizes, floats, structured formats). 'l'/'L' count by the buffer's itemsize. */
static int int_buffer_width(const Py_buffer *b, int *is_signed) {
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (f[0] == 0 || f[1] != 0) return 0;
    const int sz = (int)b->itemsize;
    if (sz == 8 && (*f == 'q' || *f == 'l' || *f == 'n')) { *is_signed = 1; return 8; }
    if (sz == 8 && (*f == 'Q' || *f == 'L' || *f == 'N')) { *is_signed = 0; return 8; }
    if (sz == 4 && (*f == 'i' || *f == 'l')) { *is_signed = 1; return 4; }
    if (sz == 4 && (*f == 'I' || *f == 'L')) { *is_signed = 0; return 4; }
    return 0;
}

static int idx_open(PyObject *o, idx_t *ix) {
    memset(ix, 0, sizeof(*ix));
    if (PyLong_Check(o)) {
        ix->scalar = PyLong_AsLongLong(o);
        if (ix->scalar == -1 && PyErr_Occurred()) return -1;
        ix->is_scalar = 1;
        ix->n = 1;
        return 0;
    }
    if (PyList_Check(o) || PyTuple_Check(o)) {
        ix->seq = o;
        ix->n = PySequence_Fast_GET_SIZE(o);
        return 0;
    }
    if (PyObject_GetBuffer(o, &ix->buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    ix->has_buf = 1;
    int is_signed;
    if (int_buffer_width(&ix->buf, &is_signed) != 8) {
        PyErr_SetString(PyExc_TypeError, "index arrays must be 64-bit integers");
        PyBuffer_Release(&ix->buf);
        ix->has_buf = 0;
        return -1;
    }
    ix->n = ix->buf.len / 8;
    return 0;
}

/* The list item i, a new reference, or NULL with an exception set if the list has shrunk below i + 1:
 * an item's __index__ runs Python code, which may change the list being read. */
static PyObject *seq_item(PyObject *seq, Py_ssize_t i) {
    if (i >= PySequence_Fast_GET_SIZE(seq)) {
        PyErr_SetString(PyExc_ValueError, "index list changed size while it was read");
        return NULL;
    }
    PyObject *it = PySequence_Fast_ITEMS(seq)[i];
    Py_INCREF(it);
    return it;
}

static int idx_get(idx_t *ix, Py_ssize_t i, long long *out) {
    if (ix->is_scalar) { *out = ix->scalar; return 0; }
    if (ix->has_buf) { *out = ((long long *)ix->buf.buf)[i]; return 0; }
    PyObject *it = seq_item(ix->seq, i);
    if (!it) return -1;
    long long v = PyLong_AsLongLong(it);
    Py_DECREF(it);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "index %zd is not an int", i);
        return -1;
    }
    *out = v;
    return 0;
}

static void idx_close(idx_t *ix) {
    if (ix->has_buf) PyBuffer_Release(&ix->buf);
}

/*
 * submit(op, pid, dst_addr, dst_len, dst_idx, src_addr, src_len, src_idx, fds, guards,
 *        nthreads, inline_bytes, sync[, dst_off]) -> Job | None
 *
 * dst_* and src_*: uint64 arrays of a prepared list (address or file offset, length);
 * *_idx: indices into them (list, int, or int64 array). fds: int64 array parallel to the FILE
 * side's descriptors (or None). guards: uint64 array of (state_ptr, expected, inflight_ptr)
 * triples or None. dst_off (OP_MMWRITE only, optional): uint64 array parallel to dst_addr, the
 * file offsets of the mapped destinations; with it, runs whose pages are not in the page cache
 * go through pwritev. Returns None when the job ran inline and succeeded.
 */
static PyObject *submit_impl(PyObject *args, int as_plan) {
    int op, nthreads, sync;
    long long pid;
    unsigned long long inline_bytes;
    PyObject *da, *dl, *di, *sa, *sl, *si, *fds_o, *guards_o, *off_o = Py_None;
    if (!PyArg_ParseTuple(args, "iLOOOOOOOOiKi|O", &op, &pid, &da, &dl, &di, &sa, &sl, &si, &fds_o, &guards_o,
                          &nthreads, &inline_bytes, &sync, &off_o))
        return NULL;
    if (op < OP_MEMCPY || op > OP_MMWRITE) {
        PyErr_SetString(PyExc_ValueError, "bad op");
        return NULL;
    }
    if (op == OP_MMWRITE) {
        int ie = mm_install();
        if (ie) return raise_errno(ie);
    }
    Py_buffer bda, bdl, bsa, bsl, bfd, bg, boff;
    int have_fd = 0, have_g = 0, have_off = 0;
    idx_t ixd, ixs;
    job_t *j = NULL;
    PyObject *ret = NULL;
    if (get_u64(da, &bda, "dst_addr") < 0) return NULL;
    if (get_u64(dl, &bdl, "dst_len") < 0) goto e1;
    if (get_u64(sa, &bsa, "src_addr") < 0) goto e2;
    if (get_u64(sl, &bsl, "src_len") < 0) goto e3;
    if (idx_open(di, &ixd) < 0) goto e4;
    if (idx_open(si, &ixs) < 0) goto e5;
    if (fds_o != Py_None) {
        if (get_u64(fds_o, &bfd, "fds") < 0) goto e6;
        have_fd = 1;
    }
    if (guards_o != Py_None) {
        if (get_u64(guards_o, &bg, "guards") < 0) goto e7;
        have_g = 1;
    }
    Py_ssize_t n = ixd.n;
    if (ixs.n != n) {
        PyErr_Format(PyExc_ValueError, "index lists differ in length (%zd vs %zd)", n, ixs.n);
        goto e8;
    }
    Py_ssize_t nd = bda.len / 8, ns = bsa.len / 8;
    if (bdl.len != bda.len || bsl.len != bsa.len) {
        PyErr_SetString(PyExc_ValueError, bdl.len != bda.len ? "dst_len must be as long as dst_addr"
                                                              : "src_len must be as long as src_addr");
        goto e8;
    }
    if (have_fd && bfd.len != ((op == OP_PWRITE || op == OP_MMWRITE) ? bda.len : bsa.len)) {
        PyErr_SetString(PyExc_ValueError, "fds must be as long as the file side's descriptor list");
        goto e8;
    }
    if (off_o != Py_None) {
        if (op != OP_MMWRITE) { PyErr_SetString(PyExc_ValueError, "dst_off is for OP_MMWRITE only"); goto e8; }
        if (get_u64(off_o, &boff, "dst_off") < 0) goto e8;
        have_off = 1;
        if (boff.len / 8 != nd) { PyErr_SetString(PyExc_ValueError, "dst_off must be as long as dst_addr"); goto e8; }
    }
    const uint64_t *poff = have_off ? boff.buf : NULL;
    const uint64_t *pda = bda.buf, *pdl = bdl.buf, *psa = bsa.buf, *psl = bsl.buf;
    const int64_t *pfd = have_fd ? bfd.buf : NULL;
    /* small posts (the latency path) build their job on the stack: no allocation at all */
    job_t sjob;
    triplet_t strip[SMALL_N];
    guard_t sguard[SMALL_N];
    size_t ngu = have_g ? (size_t)(bg.len / 24) : 0;
    int on_stack = !as_plan && n <= SMALL_N && ngu <= SMALL_N;
    if (on_stack) {
        memset(&sjob, 0, sizeof sjob);
        j = &sjob;
        j->t = strip;
    } else {
        j = calloc(1, sizeof(job_t));
        if (!j) { PyErr_NoMemory(); goto e8; }
        size_t cap = n ? (size_t)n : 1;
        j->t = malloc(cap * sizeof(triplet_t));
        if (!j->t) { PyErr_NoMemory(); goto e9; }
    }
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long a, b;
        if (idx_get(&ixd, i, &a) < 0 || idx_get(&ixs, i, &b) < 0) goto e9;
        if (a < 0) a += nd;
        if (b < 0) b += ns;
        if (a < 0 || a >= nd) { PyErr_Format(PyExc_IndexError, "destination index %lld out of range (list of %zd)", a, nd); goto e9; }
        if (b < 0 || b >= ns) { PyErr_Format(PyExc_IndexError, "source index %lld out of range (list of %zd)", b, ns); goto e9; }
        if (pdl[a] != psl[b]) {
            PyErr_Format(PyExc_ValueError, "descriptor lengths differ at position %zd (%llu vs %llu bytes)", i,
                         (unsigned long long)pdl[a], (unsigned long long)psl[b]);
            goto e9;
        }
        triplet_t *x = &j->t[i];
        x->dst = pda[a];
        x->src = psa[b];
        x->len = pdl[a];
        x->fd = 0;
        if (pfd) x->fd = (op == OP_PWRITE || op == OP_MMWRITE) ? pfd[a] : pfd[b];
        x->off = poff ? poff[a] : 0;
        total += x->len;
    }
    j->nt = (size_t)n;
    j->nbytes = total;
    j->op = op;
    j->pid = (pid_t)pid;
    j->sync = sync;
    j->has_off = have_off;
    if (have_g) {
        size_t ng = ngu;
        j->g = on_stack ? sguard : malloc((ng ? ng : 1) * sizeof(guard_t));
        if (!j->g) { PyErr_NoMemory(); goto e9; }
        const uint64_t *pg = bg.buf;
        for (size_t k = 0; k < ng; k++) {
            j->g[k].state = (_Atomic uint64_t *)(uintptr_t)pg[3 * k];
            j->g[k].expected = pg[3 * k + 1];
            j->g[k].inflight = (_Atomic uint32_t *)(uintptr_t)pg[3 * k + 2];
        }
        j->ng = ng;
    }
    if (on_stack) {
        if (total <= inline_bytes) {
            int ge = guards_enter(j->g, j->ng);
            if (ge) { raise_errno(ge); j = NULL; goto e8; }
            int e = run_inline(j);
            j = NULL;
            if (e) { raise_errno(e); goto e8; }
            ret = PyLong_FromUnsignedLongLong(total);
            goto e8;
        }
        /* too big to run inline: move it to the heap for the pool */
        job_t *h = calloc(1, sizeof(job_t));
        triplet_t *ht = malloc((j->nt ? j->nt : 1) * sizeof(triplet_t));
        guard_t *hg = malloc((j->ng ? j->ng : 1) * sizeof(guard_t));
        if (!h || !ht || !hg) { free(h); free(ht); free(hg); j = NULL; PyErr_NoMemory(); goto e8; }
        *h = *j;
        memcpy(ht, j->t, j->nt * sizeof(triplet_t));
        if (j->ng) memcpy(hg, j->g, j->ng * sizeof(guard_t));
        h->t = ht;
        h->g = hg;
        j = h;
        on_stack = 0;
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    if (as_plan) {
        PlanObject *po = PyObject_New(PlanObject, &PlanType);
        if (!po) { job_free(j); j = NULL; goto e8; }
        po->tpl = j;
        po->nthreads = nthreads;
        po->inline_bytes = inline_bytes;
        ret = (PyObject *)po;
    } else {
        ret = job_start(j, nthreads, inline_bytes, 1);
    }
    j = NULL;
    goto e8;
e9:
    if (j && !on_stack) { free(j->t); free(j->g); free(j); }
e8:
    if (have_off) PyBuffer_Release(&boff);
    if (have_g) PyBuffer_Release(&bg);
e7:
    if (have_fd) PyBuffer_Release(&bfd);
e6:
    idx_close(&ixs);
e5:
    idx_close(&ixd);
e4:
    PyBuffer_Release(&bsl);
e3:
    PyBuffer_Release(&bsa);
e2:
    PyBuffer_Release(&bdl);
e1:
    PyBuffer_Release(&bda);
    return ret;
}

static PyObject *py_submit(PyObject *self, PyObject *args) {
    (void)self;
    return submit_impl(args, 0);
}

static PyObject *py_plan(PyObject *self, PyObject *args) {
    (void)self;
    return submit_impl(args, 1);
}

/* map_fd(fd, size, offset, writable) -> address */
static PyObject *py_map_fd(PyObject *self, PyObject *args) {
    (void)self;
    int fd, writable;
    unsigned long long size, off;
    if (!PyArg_ParseTuple(args, "iKKp", &fd, &size, &off, &writable)) return NULL;
    void *p = mmap(NULL, size, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, (off_t)off);
    if (p == MAP_FAILED) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)p);
}

static PyObject *py_unmap(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long addr, size;
    if (!PyArg_ParseTuple(args, "KK", &addr, &size)) return NULL;
    if (munmap((void *)(uintptr_t)addr, size) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* mmwrite_flags(flags=-1) -> int: OP_MMWRITE's switches, process-wide; sets them when flags >= 0
 * and returns the previous value. Bit 1 (MMWRITE_POPULATE): madvise(MADV_POPULATE_WRITE) before
 * the copy (a kernel answering EINVAL/ENOSYS disables it for good, whatever the bit). Bit 2
 * (MMWRITE_RESIDENT): runs not fully in the page cache, where the file has data on disk, go
 * through pwritev. Default: both. Tests clear them to reach the EFAULT and SIGBUS paths. */
static PyObject *py_mmwrite_flags(PyObject *self, PyObject *args) {
    (void)self;
    int flags = -1;
    if (!PyArg_ParseTuple(args, "|i", &flags)) return NULL;
    int prev = flags >= 0 ? atomic_exchange(&mm_flags, flags & (MM_POPULATE | MM_RESIDENT)) : atomic_load(&mm_flags);
    return PyLong_FromLong(prev);
}

/* store64(addr, value) / load64(addr) / load32(addr): atomic accesses to shared control pages */
static PyObject *py_store64(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long addr, v;
    if (!PyArg_ParseTuple(args, "KK", &addr, &v)) return NULL;
    atomic_store((_Atomic uint64_t *)(uintptr_t)addr, (uint64_t)v);
    Py_RETURN_NONE;
}

static PyObject *py_load64(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(atomic_load((_Atomic uint64_t *)(uintptr_t)addr));
}

static PyObject *py_load32(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLong(atomic_load((_Atomic uint32_t *)(uintptr_t)addr));
}

/* drain(addrs: uint64 array of inflight counters, timeout) -> True if all reached zero */
static PyObject *py_drain(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o;
    double timeout;
    if (!PyArg_ParseTuple(args, "Od", &o, &timeout)) return NULL;
    Py_buffer b;
    if (get_u64(o, &b, "counters") < 0) return NULL;
    const uint64_t *p = b.buf;
    Py_ssize_t n = b.len / 8;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (Py_ssize_t i = 0; i < n; i++) {
        long spins = 0;
        while (atomic_load((_Atomic uint32_t *)(uintptr_t)p[i]) != 0) {
            if (++spins > 1000) {
                struct timespec s = {0, 50000};
                nanosleep(&s, NULL);
                clock_gettime(CLOCK_MONOTONIC, &t1);
                if ((double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec) > timeout) {
                    ok = 0;
                    break;
                }
            }
        }
        if (!ok) break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyBool_FromLong(ok);
}

static PyObject *py_cma_probe(PyObject *self, PyObject *args) {
    (void)self;
    long long pid;
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "LK", &pid, &addr)) return NULL;
    uint64_t v = 0;
    struct iovec l = {&v, sizeof v}, r = {(void *)(uintptr_t)addr, sizeof v};
    ssize_t got;
    Py_BEGIN_ALLOW_THREADS
    got = process_vm_readv((pid_t)pid, &l, 1, &r, 1, 0);
    Py_END_ALLOW_THREADS
    if (got < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromUnsignedLongLong(v);
}

/* ------------------------------------------------------------------------------------------ */
/* GPU transfer helpers (the cuda backend's post path): index staging and one launch sequence */

/* index source for stage_index: an int, a list/tuple of ints, or a contiguous buffer of 4- or
 * 8-byte integers (signed or unsigned) */
typedef struct {
    PyObject *seq;
    Py_buffer buf;
    int has_buf;
    int width;    /* 4 or 8 (buffers) */
    int is_signed;
    long long scalar;
    int is_scalar;
    Py_ssize_t n;
} sidx_t;

static int sidx_open(PyObject *o, sidx_t *ix) {
    memset(ix, 0, sizeof(*ix));
    if (PyLong_Check(o) && !PyBool_Check(o)) {
        int ovf = 0;
        ix->scalar = PyLong_AsLongLongAndOverflow(o, &ovf);
        if (ix->scalar == -1 && PyErr_Occurred()) return -1;
        if (ovf) ix->scalar = -1; /* out of range either way */
        ix->is_scalar = 1;
        ix->n = 1;
        return 0;
    }
    if (PyList_Check(o) || PyTuple_Check(o)) {
        ix->seq = o;
        ix->n = PySequence_Fast_GET_SIZE(o);
        return 0;
    }
    if (PyObject_GetBuffer(o, &ix->buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    ix->has_buf = 1;
    const int sz = int_buffer_width(&ix->buf, &ix->is_signed);
    if (!sz) {
        PyErr_SetString(PyExc_TypeError, "index arrays must be 32- or 64-bit integers");
        PyBuffer_Release(&ix->buf);
        ix->has_buf = 0;
        return -1;
    }
    ix->width = sz;
    ix->n = ix->buf.len / sz;
    return 0;
}

static void sidx_close(sidx_t *ix) {
    if (ix->has_buf) PyBuffer_Release(&ix->buf);
}

/* Convert n indices to int32/int64 at dst and check 0 <= v < lim (v taken as u64: a negative index
 * is a huge one). Branch-free, so the compiler vectorizes it: for v < 2^63, lim - 1 - v wraps (top
 * bit set) exactly when v >= lim. Returns nonzero if any index is out of range. Runs without the GIL. */
#define STAGE_LOOP(OUT_T, IN_T, CONV)                                                                  \
    do {                                                                                             \
        const IN_T *s = (const IN_T *)src;                                                           \
        OUT_T *d = (OUT_T *)dst;                                                                     \
        uint64_t acc = 0, l1 = lim - 1;                                                              \
        for (Py_ssize_t i = 0; i < n; i++) {                                                         \
            uint64_t v = CONV(s[i]);                                                                 \
            acc |= v | (l1 - v);                                                                     \
            d[i] = (OUT_T)v;                                                                         \
        }                                                                                            \
        bad = acc >> 63;                                                                             \
    } while (0)
#define CONV_S32(x) ((uint64_t)(int64_t)(x))
#define CONV_U(x) ((uint64_t)(x))

static int stage_buf(void *dst, int wide, const void *src, int width, int is_signed, Py_ssize_t n, uint64_t lim) {
    uint64_t bad = 0;
    if (lim == 0) return n > 0;
    if (wide) {
        if (width == 8) STAGE_LOOP(uint64_t, uint64_t, CONV_U);
        else if (is_signed) STAGE_LOOP(uint64_t, int32_t, CONV_S32);
        else STAGE_LOOP(uint64_t, uint32_t, CONV_U);
    } else {
        if (width == 8) STAGE_LOOP(uint32_t, uint64_t, CONV_U);
        else if (is_signed) STAGE_LOOP(uint32_t, int32_t, CONV_S32);
        else STAGE_LOOP(uint32_t, uint32_t, CONV_U);
    }
    return (int)bad;
}

/* Large index arrays (a post of 4 KiB blocks stages 2 x 65,536 indices: 1.5 MiB of memory traffic,
 * 40-110 us on one core of the GPU machines) are converted by the calling thread and a few helper
 * threads at once, each a contiguous piece. The helpers are started once per process (after a
 * fork, again) and sleep on a condition variable between posts. One post at a time uses them
 * (another concurrent one converts alone); the caller claims pieces too, so it never waits for a
 * helper that has not started one: only for pieces already being converted. */
#define STAGE_PAR_MIN 32768 /* indices per array from which helpers join */
#define STAGE_HELPERS 3
#define STAGE_PIECES 8 /* per array */

typedef struct {
    void *dst;
    const void *src;
    int width, is_signed;
    Py_ssize_t n;
    uint64_t lim;
} stage_piece_t;

/* 0: the calling thread converts alone; 1: helpers join on machines with 4 or more CPUs; 2: always */
static _Atomic int stage_parallel = 1;
static pthread_mutex_t sp_call = PTHREAD_MUTEX_INITIALIZER; /* one parallel staging at a time */
static pthread_mutex_t sp_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sp_cv = PTHREAD_COND_INITIALIZER;
static stage_piece_t sp_piece[2 * STAGE_PIECES];
static int sp_wide;
static _Atomic int sp_count, sp_next, sp_left, sp_bad;
static uint64_t sp_gen;
static int sp_threads;
static long sp_ncpu; /* online CPUs, read once */

/* fork: as for the copy pool (sync_reset) */
static void sp_atfork_prepare(void) { pthread_mutex_lock(&sp_mu); }
static void sp_atfork_parent(void) { pthread_mutex_unlock(&sp_mu); }
static void sp_atfork_child(void) {
    sync_reset(&sp_mu, &sp_cv);
    sync_reset(&sp_call, NULL); /* a post staging on another thread of the parent is not in the child */
    sp_threads = 0;
}
static pthread_once_t sp_once = PTHREAD_ONCE_INIT;
static void sp_init(void) {
    sp_ncpu = sysconf(_SC_NPROCESSORS_ONLN); /* glibc reads /sys for it: not once per post */
    pthread_atfork(sp_atfork_prepare, sp_atfork_parent, sp_atfork_child);
}

static void sp_run(void) {
    for (;;) {
        const int i = atomic_fetch_add(&sp_next, 1);
        if (i >= atomic_load(&sp_count)) return; /* also a helper late from an earlier post: sp_next is past it */
        const stage_piece_t *p = &sp_piece[i];
        if (stage_buf(p->dst, sp_wide, p->src, p->width, p->is_signed, p->n, p->lim)) atomic_store(&sp_bad, 1);
        atomic_fetch_sub(&sp_left, 1);
    }
}

static void *sp_worker(void *arg) {
    (void)arg;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&sp_mu);
        while (sp_gen == seen) pthread_cond_wait(&sp_cv, &sp_mu);
        seen = sp_gen;
        pthread_mutex_unlock(&sp_mu);
        sp_run();
    }
    return NULL;
}

/* Convert both arrays (as stage_buf) with the helpers; returns nonzero bits 1/2 if an index of the
 * first/second array is out of range, or -1 if the helpers are busy or cannot start (then the
 * caller converts alone). Called without the GIL. */
static int stage_par(void *d0, const sidx_t *a, Py_ssize_t nd, void *d1, const sidx_t *b, Py_ssize_t ns, int wide,
                     Py_ssize_t n) {
    pthread_once(&sp_once, sp_init);
    if (atomic_load(&stage_parallel) < 2 && sp_ncpu < 4) return -1; /* too few cores to gain: they would compete */
    if (pthread_mutex_trylock(&sp_call)) return -1;
    pthread_mutex_lock(&sp_mu);
    while (sp_threads < STAGE_HELPERS && !spawn_detached(sp_worker)) sp_threads++;
    if (!sp_threads) {
        pthread_mutex_unlock(&sp_mu);
        pthread_mutex_unlock(&sp_call);
        return -1;
    }
    const size_t isz = wide ? 8 : 4;
    const Py_ssize_t per = (n + STAGE_PIECES - 1) / STAGE_PIECES;
    int k = 0, first = 0;
    for (int side = 0; side < 2; side++) {
        const sidx_t *x = side ? b : a;
        char *d = side ? d1 : d0;
        for (Py_ssize_t lo = 0; lo < n; lo += per) {
            const Py_ssize_t m = n - lo < per ? n - lo : per;
            stage_piece_t *p = &sp_piece[k++];
            p->dst = d + (size_t)lo * isz;
            p->src = (const char *)x->buf.buf + (size_t)lo * (size_t)x->width;
            p->width = x->width;
            p->is_signed = x->is_signed;
            p->n = m;
            p->lim = (uint64_t)(side ? ns : nd);
        }
        if (side == 0) first = k; /* pieces [0, first) belong to the first array */
    }
    sp_wide = wide;
    atomic_store(&sp_count, k);
    atomic_store(&sp_bad, 0);
    atomic_store(&sp_left, k);
    atomic_store(&sp_next, 0);
    sp_gen++;
    pthread_cond_broadcast(&sp_cv);
    pthread_mutex_unlock(&sp_mu);
    sp_run(); /* every piece is claimed once this returns: wait only for those still being converted */
    while (atomic_load(&sp_left) > 0) sched_yield();
    int out = 0;
    if (atomic_load(&sp_bad)) { /* which array: check each again (rare: bad input) */
        for (int i = 0; i < k; i++) {
            const stage_piece_t *p = &sp_piece[i];
            if (stage_buf(p->dst, wide, p->src, p->width, p->is_signed, p->n, p->lim)) out |= i < first ? 1 : 2;
        }
    }
    pthread_mutex_unlock(&sp_call);
    return out;
}

/* Stage an int or a list/tuple index source at dst (n entries, int32 or int64), under the GIL;
 * -1 with an exception set on failure. */
static int stage_seq(sidx_t *ix, void *dst, int wide, Py_ssize_t limit) {
    Py_ssize_t n = ix->n;
    uint64_t mx = 0;
    if (ix->is_scalar) {
        mx = (uint64_t)ix->scalar;
        if (wide) *(uint64_t *)dst = mx; else *(uint32_t *)dst = (uint32_t)mx;
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *it = seq_item(ix->seq, i);
            if (!it) return -1;
            if (PyBool_Check(it) || !PyIndex_Check(it)) {
                PyErr_Format(PyExc_TypeError, "indices must be integers (index %zd is %s)", i, Py_TYPE(it)->tp_name);
                Py_DECREF(it);
                return -1;
            }
            int ovf = 0;
            long long v;
            if (PyLong_Check(it)) {
                v = PyLong_AsLongLongAndOverflow(it, &ovf);
            } else {
                PyObject *l = PyNumber_Index(it);
                if (!l) { Py_DECREF(it); return -1; }
                v = PyLong_AsLongLongAndOverflow(l, &ovf);
                Py_DECREF(l);
            }
            Py_DECREF(it);
            if (v == -1 && PyErr_Occurred()) return -1;
            uint64_t u = ovf ? UINT64_MAX : (uint64_t)v;
            mx = u > mx ? u : mx;
            if (u >= (uint64_t)limit) break; /* reported below */
            if (wide) ((uint64_t *)dst)[i] = u; else ((uint32_t *)dst)[i] = (uint32_t)u;
        }
    }
    if (n && mx >= (uint64_t)limit) {
        PyErr_Format(PyExc_IndexError, "descriptor index out of range for a list of %zd", limit);
        return -1;
    }
    return 0;
}

/* Check two opened index sources against their lists' lengths (nd, ns) and each other, and stage them
 * at addr (cap bytes): the n destination indices, then the n source indices, int32 or int64 (wide).
 * Returns n, or -1 with an exception set. Large arrays are converted without the GIL. */
static Py_ssize_t stage_pair(sidx_t *a, sidx_t *b, Py_ssize_t nd, Py_ssize_t ns, int wide, unsigned long long addr,
                             unsigned long long cap) {
    const Py_ssize_t n = a->n;
    const size_t isz = wide ? 8 : 4;
    if (b->n != n) {
        PyErr_SetString(PyExc_ValueError, "index lists differ in length");
        return -1;
    }
    if ((unsigned long long)n * 2 * isz > cap || (n && !addr)) {
        PyErr_Format(PyExc_ValueError, "staging buffer of %llu bytes too small for %zd index pairs", cap, n);
        return -1;
    }
    char *d0 = (char *)(uintptr_t)addr, *d1 = d0 + (size_t)n * isz;
    if (!a->has_buf && stage_seq(a, d0, wide, nd) < 0) return -1;
    if (!b->has_buf && stage_seq(b, d1, wide, ns) < 0) return -1;
    if (n && (a->has_buf || b->has_buf)) {
        int bad0 = 0, bad1 = 0;
        PyThreadState *ts = n >= 4096 ? PyEval_SaveThread() : NULL; /* one GIL release for both arrays */
        const int par = n >= STAGE_PAR_MIN && a->has_buf && b->has_buf && stage_parallel
                            ? stage_par(d0, a, nd, d1, b, ns, wide, n) : -1;
        if (par >= 0) {
            bad0 = par & 1;
            bad1 = par & 2;
        } else {
            if (a->has_buf) bad0 = stage_buf(d0, wide, a->buf.buf, a->width, a->is_signed, n, (uint64_t)nd);
            if (b->has_buf) bad1 = stage_buf(d1, wide, b->buf.buf, b->width, b->is_signed, n, (uint64_t)ns);
        }
        if (ts) PyEval_RestoreThread(ts);
        if (bad0 || bad1) {
            PyErr_Format(PyExc_IndexError, "descriptor index out of range for a list of %zd", bad0 ? nd : ns);
            return -1;
        }
    }
    return n;
}

/*
 * stage_index(dst_idx, n_dst, src_idx, n_src, addr, cap, wide) -> n
 *
 * The cuda backend's index staging: checks both index sources (int, list/tuple of ints, or a
 * contiguous 32/64-bit integer array) against the lengths of their lists (0 <= i < n_*), checks
 * that they pair up, and writes them to addr (a pinned staging buffer of cap bytes): the n
 * destination indices, then the n source indices, as int32 (wide=0; the caller makes sure both
 * lists have fewer than 2^31 entries) or int64. Arrays are converted without the GIL.
 */
static PyObject *py_stage_index(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *di, *si;
    Py_ssize_t nd, ns;
    unsigned long long addr, cap;
    int wide;
    if (!PyArg_ParseTuple(args, "OnOnKKp", &di, &nd, &si, &ns, &addr, &cap, &wide)) return NULL;
    if (nd < 0 || ns < 0) {
        PyErr_SetString(PyExc_ValueError, "negative list length");
        return NULL;
    }
    if (!wide && (nd > INT32_MAX || ns > INT32_MAX)) {
        PyErr_SetString(PyExc_ValueError, "int32 indices need lists shorter than 2^31");
        return NULL;
    }
    sidx_t a, b;
    if (sidx_open(di, &a) < 0) return NULL;
    if (sidx_open(si, &b) < 0) { sidx_close(&a); return NULL; }
    PyObject *ret = NULL;
    const Py_ssize_t n = stage_pair(&a, &b, nd, ns, wide, addr, cap);
    if (n < 0) goto out;
    ret = PyLong_FromSsize_t(n);
out:
    sidx_close(&b);
    sidx_close(&a);
    return ret;
}

/* stage_parallel(mode=-1) -> previous mode: large index arrays converted by the calling thread alone (0),
 * with helper threads on machines with 4 or more CPUs (1, the default), or always with helpers (2) */
static PyObject *py_stage_parallel(PyObject *self, PyObject *args) {
    (void)self;
    int mode = -1;
    if (!PyArg_ParseTuple(args, "|i", &mode)) return NULL;
    if (mode > 2) {
        PyErr_SetString(PyExc_ValueError, "stage_parallel: mode 0, 1 or 2");
        return NULL;
    }
    const int prev = mode >= 0 ? atomic_exchange(&stage_parallel, mode) : atomic_load(&stage_parallel);
    return PyLong_FromLong(prev);
}

/* CUDA driver entry points, passed in as addresses (ctypes gives them; nothing is linked here) */
typedef int (*cu_memcpy_htod_fn)(uint64_t dst, const void *src, size_t n, void *stream);
typedef int (*cu_launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned shmem, void *stream, void **params, void **extra);
typedef int (*cu_record_fn)(void *event, void *stream);

/* Launch the copy kernel func (grid x threads) on stream with its arguments: the eight u64 a[] and
 * the u32 work-item shift; the CUDA error or 0. Shared by cuda_post and CudaRoute.post. */
static int launch_copy(cu_launch_fn launch, void *func, unsigned grid, unsigned threads, void *stream, uint64_t a[8],
                       uint32_t shift) {
    void *params[9];
    for (int i = 0; i < 8; i++) params[i] = &a[i];
    params[8] = &shift;
    return launch(func, grid, 1, 1, threads, 1, 1, 0, stream, params, NULL);
}

/*
 * cuda_post(memcpy_fn, launch_fn, record_fn, dptr, hptr, nbytes, stream, func, grid, threads,
 *           a0, ..., a7, shift, event) -> (step, rc)
 *
 * One kernel transfer's CUDA calls in one go, without the GIL: cuMemcpyHtoDAsync(dptr, hptr,
 * nbytes, stream) (skipped when nbytes is 0), cuLaunchKernel(func, grid, threads, params =
 * eight u64 a0..a7 and the u32 shift, on stream) (skipped when func is 0), cuEventRecord(event,
 * stream) (skipped when event is 0). The *_fn arguments are the driver functions' addresses. Stops at the first failure: returns (step, rc) with step 0/1/2 for the copy, the launch,
 * the record, and rc the CUDA error; (3, 0) when all succeeded. The caller makes the right context
 * current (CUDA_ERROR_INVALID_CONTEXT otherwise).
 */
static PyObject *py_cuda_post(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long fm, fl, fr, dptr, hptr, nbytes, stream, func, ev;
    unsigned int grid, threads, shift;
    unsigned long long a[8];
    if (!PyArg_ParseTuple(args, "KKKKKKKKIIKKKKKKKKIK", &fm, &fl, &fr, &dptr, &hptr, &nbytes, &stream, &func, &grid,
                          &threads, &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6], &a[7], &shift, &ev))
        return NULL;
    if ((func && !fl) || (nbytes && !fm) || (ev && !fr)) {
        PyErr_SetString(PyExc_ValueError, "cuda_post: missing function");
        return NULL;
    }
    uint64_t pv[8];
    for (int i = 0; i < 8; i++) pv[i] = a[i];
    int step = 0, rc = 0;
    void *st = (void *)(uintptr_t)stream;
    Py_BEGIN_ALLOW_THREADS
    if (nbytes) rc = ((cu_memcpy_htod_fn)(uintptr_t)fm)(dptr, (const void *)(uintptr_t)hptr, (size_t)nbytes, st);
    if (!rc) {
        step = 1;
        if (func) rc = launch_copy((cu_launch_fn)(uintptr_t)fl, (void *)(uintptr_t)func, grid, threads, st, pv, shift);
    }
    if (!rc) {
        step = 2;
        if (ev) rc = ((cu_record_fn)(uintptr_t)fr)((void *)(uintptr_t)ev, st);
    }
    if (!rc) step = 3;
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(ii)", step, rc);
}

/*
 * cuda_event_spin(query_fn, event, max_ns) -> rc
 *
 * Poll cuEventQuery(event) without the GIL until it is no longer CUDA_ERROR_NOT_READY (600) or
 * max_ns nanoseconds have passed; returns its last result (0: the event has completed, 600: still
 * pending at the bound, anything else: the CUDA error). query_fn is cuEventQuery's address.
 * A waiter that spins here sees a finished copy within a microsecond or two and leaves the GIL to
 * other threads meanwhile (a Python loop that yields the GIL between polls saw it 30-50 us late).
 * max_ns 0: one query with the GIL held (a poll: handing the GIL over for it could cost a switch
 * interval; cupy's Event.done costs ~1 us more).
 */
typedef int (*cu_query_fn)(void *event);

static PyObject *py_cuda_event_spin(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long fq, ev, max_ns;
    if (!PyArg_ParseTuple(args, "KKK", &fq, &ev, &max_ns)) return NULL;
    if (!fq || !ev) {
        PyErr_SetString(PyExc_ValueError, "cuda_event_spin: missing function or event");
        return NULL;
    }
    int rc;
    if (max_ns == 0) return PyLong_FromLong(((cu_query_fn)(uintptr_t)fq)((void *)(uintptr_t)ev));
    Py_BEGIN_ALLOW_THREADS
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        rc = ((cu_query_fn)(uintptr_t)fq)((void *)(uintptr_t)ev);
        if (rc != 600) break;
        clock_gettime(CLOCK_MONOTONIC, &t);
        uint64_t el = (uint64_t)(t.tv_sec - t0.tv_sec) * 1000000000ull + (uint64_t)t.tv_nsec - (uint64_t)t0.tv_nsec;
        if (el >= max_ns) break;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/*
 * CudaRoute(launch_fn, record_fn, ctx_get_fn, ctx_set_fn, ctx, stream, func, threads, grid_cap, shift,
 *           dst_addrs, src_addrs, src_lens, ulen, n_dst, n_src, wide, guards[, min_shift])
 *
 * One route of the cuda backend (an op between two prepared lists of equal block length on one
 * GPU, run by the gather kernel with its indices read in place from a pinned staging slot), built
 * once; post() then does the whole launch in one call. guards: a uint64 buffer of (state address,
 * wanted value, in-flight counter address) triples (the target's registrations the transfer
 * writes or reads), copied here.
 *
 * post(dst_idx, src_idx, slot, cap, event) -> (n, step, rc)
 *   1. checks both index sources (as stage_index) and stages them at slot (cap bytes) as int32 or
 *      int64: a bad index raises TypeError/ValueError/IndexError and nothing else happens;
 *   2. raises each guard's in-flight counter (seq-cst), then checks every state still holds its
 *      wanted value; if one does not, lowers the counters again and returns step -1;
 *   3. makes ctx current if it is not, launches the kernel (n pairs, chunk items of 2^shift bytes;
 *      while that leaves at most half as many items as the grid has warps, chunks half as large,
 *      down to 2^min_shift, default shift) on stream, records event (if nonzero), restores the
 *      previous context.
 *   step 3 and rc 0: launched. step 0 (context switch), 1 (launch) or 2 (record) with the CUDA
 *   error rc: the guards' counters stay raised (the caller lowers them after synchronizing).
 * Run with the GIL held except while large index arrays are staged (the launch itself takes a
 * few microseconds; handing the GIL around it would cost more). The caller serializes posts on
 * one stream and keeps the slot, the guards' pages and the device arrays alive.
 */
typedef int (*cu_ctx_get_fn)(void **ctx);
typedef int (*cu_ctx_set_fn)(void *ctx);

typedef struct {
    PyObject_HEAD
    cu_launch_fn launch;
    cu_record_fn record;
    cu_ctx_get_fn ctx_get;
    cu_ctx_set_fn ctx_set;
    void *ctx, *stream, *func;
    unsigned threads, grid_cap, shift, min_shift;
    uint64_t dst_addrs, src_addrs, src_lens, ulen, cpd;
    Py_ssize_t n_dst, n_src;
    int wide;
    Py_ssize_t nguards;
    uint64_t *guards; /* nguards triples */
} RouteObject;

static void Route_dealloc(RouteObject *self) {
    free(self->guards);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Route_init(RouteObject *self, PyObject *args, PyObject *kw) {
    (void)kw;
    unsigned long long fl, fr, fg, fs, ctx, stream, func, dA, sA, sL, ulen;
    unsigned int threads, cap, shift, min_shift = 99;
    Py_ssize_t nd, ns;
    int wide;
    PyObject *guards;
    if (!PyArg_ParseTuple(args, "KKKKKKKIIIKKKKnnpO|I", &fl, &fr, &fg, &fs, &ctx, &stream, &func, &threads, &cap,
                          &shift, &dA, &sA, &sL, &ulen, &nd, &ns, &wide, &guards, &min_shift))
        return -1;
    if (min_shift > shift) min_shift = shift;
    if (!fl || !fr || !fg || !fs || !func || !threads || !cap || !ulen || shift > 40) {
        PyErr_SetString(PyExc_ValueError, "CudaRoute: missing function, kernel or length");
        return -1;
    }
    if (nd < 0 || ns < 0 || (!wide && (nd > INT32_MAX || ns > INT32_MAX))) {
        PyErr_SetString(PyExc_ValueError, "CudaRoute: bad list lengths");
        return -1;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(guards, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    int sg = 0;
    const int w = int_buffer_width(&b, &sg);
    if (w != 8 || b.len % 24) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "CudaRoute: guards must be uint64 triples");
        return -1;
    }
    free(self->guards);
    self->guards = NULL;
    self->nguards = b.len / 24;
    if (b.len) {
        self->guards = malloc((size_t)b.len);
        if (!self->guards) {
            PyBuffer_Release(&b);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(self->guards, b.buf, (size_t)b.len);
    }
    PyBuffer_Release(&b);
    self->launch = (cu_launch_fn)(uintptr_t)fl;
    self->record = (cu_record_fn)(uintptr_t)fr;
    self->ctx_get = (cu_ctx_get_fn)(uintptr_t)fg;
    self->ctx_set = (cu_ctx_set_fn)(uintptr_t)fs;
    self->ctx = (void *)(uintptr_t)ctx;
    self->stream = (void *)(uintptr_t)stream;
    self->func = (void *)(uintptr_t)func;
    self->threads = threads;
    self->grid_cap = cap;
    self->shift = shift;
    self->min_shift = min_shift;
    self->dst_addrs = dA;
    self->src_addrs = sA;
    self->src_lens = sL;
    self->ulen = ulen;
    self->cpd = (ulen + (1ull << shift) - 1) >> shift;
    self->n_dst = nd;
    self->n_src = ns;
    self->wide = wide;
    return 0;
}

static PyObject *Route_post(RouteObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "post(dst_idx, src_idx, slot, cap, event)");
        return NULL;
    }
    const unsigned long long addr = PyLong_AsUnsignedLongLong(args[2]);
    const unsigned long long cap = PyLong_AsUnsignedLongLong(args[3]);
    const unsigned long long ev = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    sidx_t a, b;
    if (sidx_open(args[0], &a) < 0) return NULL;
    if (sidx_open(args[1], &b) < 0) {
        sidx_close(&a);
        return NULL;
    }
    PyObject *ret = NULL;
    if (a.n == 0 && b.n == 0) {
        PyErr_SetString(PyExc_ValueError, "CudaRoute.post: no index pairs");
        goto out;
    }
    const Py_ssize_t n = stage_pair(&a, &b, self->n_dst, self->n_src, self->wide, addr, cap);
    if (n < 0) goto out;
    /* the target's registrations: counters up first, then the states checked (the target clears a
     * state, then waits for the counters to drain: one of the two sides sees the other) */
    const uint64_t *g = self->guards;
    const Py_ssize_t ng = self->nguards;
    for (Py_ssize_t i = 0; i < ng; i++) atomic_fetch_add((_Atomic uint64_t *)(uintptr_t)g[3 * i + 2], 1);
    int live = 1;
    for (Py_ssize_t i = 0; i < ng && live; i++) live = atomic_load((_Atomic uint64_t *)(uintptr_t)g[3 * i]) == g[3 * i + 1];
    if (!live) {
        for (Py_ssize_t i = 0; i < ng; i++) atomic_fetch_sub((_Atomic uint64_t *)(uintptr_t)g[3 * i + 2], 1);
        ret = Py_BuildValue("(nii)", n, -1, 0);
        goto out;
    }
    /* few items for the grid's warps: smaller chunks, so more warps share the transfer */
    uint32_t sh = self->shift;
    uint64_t cpd = self->cpd;
    const uint64_t warps = (uint64_t)self->grid_cap * self->threads / 32;
    while (sh > self->min_shift) {
        const uint64_t c = (self->ulen + (1ull << (sh - 1)) - 1) >> (sh - 1);
        if ((uint64_t)n * c > warps) break;
        sh--;
        cpd = c;
    }
    const uint64_t items = (uint64_t)n * cpd;
    uint64_t grid = (items * 32 + self->threads - 1) / self->threads;
    if (grid > self->grid_cap) grid = self->grid_cap;
    if (grid < 1) grid = 1;
    uint64_t pv[8] = {self->dst_addrs, self->src_addrs, (uint64_t)addr, self->src_lens, 0, (uint64_t)n,
                      self->ulen, items};
    int step = 0, rc;
    void *cur = NULL;
    rc = self->ctx_get(&cur);
    if (!rc && cur != self->ctx) rc = self->ctx_set(self->ctx);
    if (!rc) {
        step = 1;
        rc = launch_copy(self->launch, self->func, (unsigned)grid, self->threads, self->stream, pv, sh);
        if (!rc) {
            step = 2;
            if (ev) rc = self->record((void *)(uintptr_t)ev, self->stream);
            if (!rc) step = 3;
        }
        if (cur != self->ctx) {
            const int rc2 = self->ctx_set(cur);
            if (!rc && rc2) rc = rc2; /* step stays 3: launched; the caller reports the context error */
        }
    }
    ret = Py_BuildValue("(nii)", n, step, rc);
out:
    sidx_close(&b);
    sidx_close(&a);
    return ret;
}

static PyMethodDef Route_methods[] = {
    {"post", (PyCFunction)(void (*)(void))Route_post, METH_FASTCALL,
     "post(dst_idx, src_idx, slot, cap, event) -> (n, step, rc): stage, guard, launch, record."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject RouteType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvx._native.CudaRoute",
    .tp_basicsize = sizeof(RouteObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One GPU kernel route of the cuda backend: stage indices, guard, launch and record in one call.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Route_init,
    .tp_dealloc = (destructor)Route_dealloc,
    .tp_methods = Route_methods,
};

static PyMethodDef methods[] = {
    {"submit", py_submit, METH_VARARGS, "Build and start a batched copy job (int bytes if done inline, else Job)."},
    {"plan", py_plan, METH_VARARGS, "Build a batched copy once (same arguments as submit) for many posts."},
    {"map_fd", py_map_fd, METH_VARARGS, "mmap a file descriptor shared; returns the address."},
    {"unmap", py_unmap, METH_VARARGS, "munmap(addr, size)."},
    {"mmwrite_flags", py_mmwrite_flags, METH_VARARGS, "Get/set OP_MMWRITE's switches (MMWRITE_POPULATE, MMWRITE_RESIDENT)."},
    {"store64", py_store64, METH_VARARGS, "Atomic 64-bit store."},
    {"load64", py_load64, METH_O, "Atomic 64-bit load."},
    {"load32", py_load32, METH_O, "Atomic 32-bit load."},
    {"drain", py_drain, METH_VARARGS, "Wait until 32-bit counters reach zero, bounded."},
    {"cma_probe", py_cma_probe, METH_VARARGS, "Read 8 bytes of another process with process_vm_readv."},
    {"stage_index", py_stage_index, METH_VARARGS, "Check two index sources and write them as int32/int64 at an address."},
    {"stage_parallel", py_stage_parallel, METH_VARARGS, "Get/set how large index arrays are staged (0 one thread, 1 helpers on 4+ CPUs, 2 helpers)."},
    {"cuda_post", py_cuda_post, METH_VARARGS, "cuMemcpyHtoDAsync + cuLaunchKernel + cuEventRecord without the GIL."},
    {"cuda_event_spin", py_cuda_event_spin, METH_VARARGS, "Poll cuEventQuery without the GIL, bounded in time."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "kvx._native", "Native copy engine of kvx.", -1, methods,
                                 NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&JobType) < 0) return NULL;
    if (PyType_Ready(&PlanType) < 0) return NULL;
    if (PyType_Ready(&RouteType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod);
    if (!m) return NULL;
    Py_INCREF(&JobType);
    PyModule_AddObject(m, "Job", (PyObject *)&JobType);
    Py_INCREF(&PlanType);
    PyModule_AddObject(m, "Plan", (PyObject *)&PlanType);
    Py_INCREF(&RouteType);
    PyModule_AddObject(m, "CudaRoute", (PyObject *)&RouteType);
    PyModule_AddIntConstant(m, "OP_MEMCPY", OP_MEMCPY);
    PyModule_AddIntConstant(m, "OP_CMA_WRITE", OP_CMA_WRITE);
    PyModule_AddIntConstant(m, "OP_CMA_READ", OP_CMA_READ);
    PyModule_AddIntConstant(m, "OP_PWRITE", OP_PWRITE);
    PyModule_AddIntConstant(m, "OP_PREAD", OP_PREAD);
    PyModule_AddIntConstant(m, "OP_MMWRITE", OP_MMWRITE);
    PyModule_AddIntConstant(m, "MMWRITE_POPULATE", MM_POPULATE);
    PyModule_AddIntConstant(m, "MMWRITE_RESIDENT", MM_RESIDENT);
    return m;
}
