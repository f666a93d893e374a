/* kvx._native, the copy engine: streaming copies, writes through shared file mappings with their
 * SIGBUS guard, running a job's ranges, the guards of one-sided copies, and the thread pool. */
#include "kvx_native.h"

/* ------------------------------------------------------------------------------------------ */
/* pool */

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static chunk_t *q_head = NULL, *q_tail = NULL;
static int pool_threads = 0;

void job_release(job_t *j) {
    if (atomic_fetch_sub(&j->refs, 1) == 1) {
        free(j->t);
        free(j->g);
        free(j->dig);
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
/* mm_flags: MM_POPULATE | MM_RESIDENT (kvx_native.h), all on by default; tests turn them off to reach
 * the fault paths */
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
int mm_install(void) {
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

/* Whether the first, middle and last page of [a, b) (page-aligned, mapped) are in the page cache. */
static int mm_probe_resident(uintptr_t a, uintptr_t b) {
    const uintptr_t probe[3] = {a, a + ((b - a) / mm_page / 2) * mm_page, b - mm_page};
    for (int p = 0; p < 3; p++) {
        if (p && probe[p] == probe[p - 1]) continue; /* a run of one or two pages */
        unsigned char v = 0;
        if (mincore((void *)probe[p], mm_page, &v) != 0 || !(v & 1)) return 0; /* cannot tell: as if missing */
    }
    return 1;
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

/* Digests of triplets [i, k) of a job that asked for them, from their memory side (read after a preadv
 * landed, or the source of a pwritev). */
static void dig_memory(job_t *j, size_t i, size_t k) {
    if (!j->dig) return;
    const int rd = j->op == OP_PREAD || j->op == OP_MMREAD;
    for (; i < k; i++) {
        const triplet_t *x = &j->t[i];
        j->dig[i] = copy_hash(NULL, (const void *)(uintptr_t)(rd ? x->dst : x->src), x->len, 0);
    }
}

/* pwritev (OP_MMWRITE) / preadv (OP_MMREAD) descriptors [i, k) of a job: adjacent in one file, from
 * t[i].off on. */
static int mm_rw_run(job_t *j, size_t i, size_t k, int is_write) {
    triplet_t *t = j->t;
    struct iovec iov[IOV_MAX];
    int fd = (int)t[i].fd;
    while (i < k) {
        if (atomic_load_explicit(&j->cancelled, memory_order_relaxed)) return ECANCELED;
        uint64_t off = t[i].off, want = 0;
        size_t n = 0;
        while (i + n < k && n < IOV_MAX) {
            iov[n].iov_base = (void *)(uintptr_t)(is_write ? t[i + n].src : t[i + n].dst);
            iov[n].iov_len = t[i + n].len;
            want += t[i + n].len;
            n++;
        }
        int e = rw_all(fd, iov, (int)n, off, want, is_write);
        if (e) return e;
        dig_memory(j, i, i + n);
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
            e = mm_rw_run(j, i, k, 1);
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
            if (j->dig) j->dig[i] = copy_hash((void *)(uintptr_t)t[i].dst, (const void *)(uintptr_t)t[i].src, t[i].len, stream);
            else if (stream) copy_stream((void *)(uintptr_t)t[i].dst, (const void *)(uintptr_t)t[i].src, t[i].len);
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

/* OP_MMREAD: copies out of a shared file mapping, under the same SIGBUS guard as OP_MMWRITE.
 *
 * Per run of adjacent sources (same file, at most MM_RUN_MAX bytes): a run that is not in the page
 * cache goes through preadv (a fault per missing page would read the file a little at a time); a
 * cached run is copied straight out of the mapping with the streaming copy, its pages faulted in
 * by the copy itself (a read fault maps the cached pages around it, fault_around_bytes, in one
 * go). Reading a cached file this way skips preadv's per-page lookups and its cached stores into
 * the destination.
 *
 * Neither residency nor the mapping is prepared page by page: madvise(MADV_POPULATE_READ) walks
 * every page of the run even where all are mapped already, and mincore looks every page up in the
 * page cache until they are mapped, each costing close to the copy itself (docs/benchmarks.md,
 * "HiCache gets"), while the copy's own faults map many pages each. So residency is probed on the
 * first, middle and last page of a run: a file evicted or truncated under a run (what the probe is
 * for) loses those too, and a run with a hole the probe misses is still read right, by the copy's
 * faults. A truncate racing the copy, or missed by the probe, is caught by the guard (EFAULT). */
static __attribute__((noinline)) int mmread_range(job_t *j, size_t lo, size_t hi) {
    triplet_t *t = j->t;
    const int stream = j->nbytes >= STREAM_MIN;
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0)) {
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
        uint64_t start = t[i].src, end = start + t[i].len;
        size_t k = i + 1;
        while (k < hi && t[k].src == end && t[k].fd == t[i].fd && end - start < MM_RUN_MAX) end += t[k++].len;
        if (end == start) { i = k; continue; }
        int flags = atomic_load_explicit(&mm_flags, memory_order_relaxed);
        uintptr_t a = (uintptr_t)start & ~(mm_page - 1);
        uintptr_t b = ((uintptr_t)end + mm_page - 1) & ~(mm_page - 1);
        if ((flags & MM_RESIDENT) && !mm_probe_resident(a, b)) {
            e = mm_rw_run(j, i, k, 0);
            if (e) goto out;
            i = k;
            continue;
        }
        for (; i < k; i++) {
            if (j->dig) j->dig[i] = copy_hash((void *)(uintptr_t)t[i].dst, (const void *)(uintptr_t)t[i].src, t[i].len, stream);
            else if (stream) copy_stream((void *)(uintptr_t)t[i].dst, (const void *)(uintptr_t)t[i].src, t[i].len);
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

int run_range(job_t *j, size_t lo, size_t hi) {
    triplet_t *t = j->t;
    switch (j->op) {
    case OP_MMWRITE:
        return mmwrite_range(j, lo, hi);
    case OP_MMREAD:
        return mmread_range(j, lo, hi);
    case OP_STRIDED:
    case OP_STRIDED_CMA_WRITE:
    case OP_STRIDED_CMA_READ:
        return strided_range(j, lo, hi);
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
            dig_memory(j, i, i + n);
            i += n;
        }
        return 0;
    }
    }
    return EINVAL;
}

void guards_exit(job_t *j) {
    for (size_t k = 0; k < j->ng; k++) atomic_fetch_sub(j->g[k].inflight, 1);
}

int guards_enter(guard_t *g, size_t ng) {
    for (size_t k = 0; k < ng; k++) {
        atomic_fetch_add(g[k].inflight, 1);
        if (atomic_load(g[k].state) != g[k].expected) {
            for (size_t m = 0; m <= k; m++) atomic_fetch_sub(g[m].inflight, 1);
            return ESTALE;
        }
    }
    return 0;
}

void sync_fds(job_t *j) {
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
void sync_reset(pthread_mutex_t *mu, pthread_cond_t *cv) {
    static const pthread_mutex_t m0 = PTHREAD_MUTEX_INITIALIZER;
    static const pthread_cond_t c0 = PTHREAD_COND_INITIALIZER;
    memcpy(mu, &m0, sizeof m0);
    if (cv) memcpy(cv, &c0, sizeof c0);
}

/* start a detached thread running fn; 0 or the pthread_create error */
int spawn_detached(void *(*fn)(void *)) {
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

int pool_ensure(int n) {
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

/* mmwrite_flags(flags=-1) -> int: OP_MMWRITE's switches, process-wide; sets them when flags >= 0
 * and returns the previous value. Bit 1 (MMWRITE_POPULATE): madvise(MADV_POPULATE_WRITE) before
 * the copy (a kernel answering EINVAL/ENOSYS disables it for good, whatever the bit). Bit 2
 * (MMWRITE_RESIDENT): runs not fully in the page cache, where the file has data on disk, go
 * through pwritev. Default: both. Tests clear them to reach the EFAULT and SIGBUS paths. */
PyObject *py_mmwrite_flags(PyObject *self, PyObject *args) {
    (void)self;
    int flags = -1;
    if (!PyArg_ParseTuple(args, "|i", &flags)) return NULL;
    int prev = flags >= 0 ? atomic_exchange(&mm_flags, flags & (MM_POPULATE | MM_RESIDENT)) : atomic_load(&mm_flags);
    return PyLong_FromLong(prev);
}

/* Queue the chunks first..last (linked) for the pool's threads. */
void pool_push(chunk_t *first, chunk_t *last) {
    pthread_mutex_lock(&pool_mu);
    if (q_tail) q_tail->next = first; else q_head = first;
    q_tail = last;
    pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
}
