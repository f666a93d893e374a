/* kvx._native, the cuda backend's post path: index staging (with helper threads), one launch
 * sequence through driver entry points, event polls without the GIL, and CudaRoute. */
#include "kvx_native.h"

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
PyObject *py_stage_index(PyObject *self, PyObject *args) {
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
PyObject *py_stage_parallel(PyObject *self, PyObject *args) {
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
PyObject *py_cuda_post(PyObject *self, PyObject *args) {
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

PyObject *py_cuda_event_spin(PyObject *self, PyObject *args) {
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
 *           dst_addrs, src_addrs, src_lens, ulen, n_dst, n_src, wide, guards[, min_shift[, count, dst_strides,
 *           group]])
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
 * With count (> 1): strided lists of count pieces of ulen bytes per descriptor, run by the strided
 * group kernel: src_lens and dst_strides are the device arrays of the two lists' strides, items are
 * groups of 2^s consecutive pieces of one pair (s: the largest with 2^(s+1) * ulen <= group and
 * 2^s < count, then smaller while the groups leave warps of the grid idle), and the kernel takes
 * ulen | count << 32. The caller builds such a route only where 2 * ulen <= group.
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
    uint64_t count, dst_strides, group; /* strided group kernel: count > 1 */
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
    unsigned long long fl, fr, fg, fs, ctx, stream, func, dA, sA, sL, ulen, count = 0, dS = 0, group = 0;
    unsigned int threads, cap, shift, min_shift = 99;
    Py_ssize_t nd, ns;
    int wide;
    PyObject *guards;
    if (!PyArg_ParseTuple(args, "KKKKKKKIIIKKKKnnpO|IKKK", &fl, &fr, &fg, &fs, &ctx, &stream, &func, &threads, &cap,
                          &shift, &dA, &sA, &sL, &ulen, &nd, &ns, &wide, &guards, &min_shift, &count, &dS, &group))
        return -1;
    if (min_shift > shift) min_shift = shift;
    if (!fl || !fr || !fg || !fs || !func || !threads || !cap || !ulen || shift > 40) {
        PyErr_SetString(PyExc_ValueError, "CudaRoute: missing function, kernel or length");
        return -1;
    }
    if (count && (count < 2 || count >= (1ull << 31) || ulen >= (1ull << 31) || !dS || !sL || 2 * ulen > group)) {
        PyErr_SetString(PyExc_ValueError, "CudaRoute: a strided route needs count 2..2^31, pieces of at most half "
                                          "a group and both stride arrays");
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
    self->count = count;
    self->dst_strides = dS;
    self->group = group;
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
    uint32_t sh = self->shift;
    uint64_t cpd = self->cpd;
    uint64_t karg = self->ulen, first = 0;
    const uint64_t warps = (uint64_t)self->grid_cap * self->threads / 32;
    if (self->count) {
        /* groups of 2^sh consecutive pieces; smaller while they leave warps of the grid idle */
        const uint64_t cnt = self->count;
        sh = 0;
        while ((2ull << sh) * self->ulen <= self->group && (1ull << sh) < cnt) sh++;
        while (sh > 0 && (uint64_t)n * ((cnt + (1ull << sh) - 1) >> sh) < warps) sh--;
        cpd = (cnt + (1ull << sh) - 1) >> sh;
        karg = self->ulen | (cnt << 32);
        first = self->dst_strides;
    } else {
        /* few items for the grid's warps: smaller chunks, so more warps share the transfer */
        while (sh > self->min_shift) {
            const uint64_t c = (self->ulen + (1ull << (sh - 1)) - 1) >> (sh - 1);
            if ((uint64_t)n * c > warps) break;
            sh--;
            cpd = c;
        }
    }
    const uint64_t items = (uint64_t)n * cpd;
    uint64_t grid = (items * 32 + self->threads - 1) / self->threads;
    if (grid > self->grid_cap) grid = self->grid_cap;
    if (grid < 1) grid = 1;
    uint64_t pv[8] = {self->dst_addrs, self->src_addrs, (uint64_t)addr, self->src_lens, first, (uint64_t)n,
                      karg, items};
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

PyTypeObject RouteType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvx._native.CudaRoute",
    .tp_basicsize = sizeof(RouteObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One GPU kernel route of the cuda backend: stage indices, guard, launch and record in one call.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Route_init,
    .tp_dealloc = (destructor)Route_dealloc,
    .tp_methods = Route_methods,
};
