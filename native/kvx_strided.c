/*
 * Strided copies: a descriptor that is ``count`` pieces of ``len`` bytes, piece k at
 * ``addr + k * stride`` (a head slice of every token of a block), copied (memcpy, or CMA with the
 * pieces as iovecs) with one triplet per descriptor pair instead of one per piece. The job's triplet carries the pattern in the fields
 * memcpy jobs leave unused: ``fd`` = count, ``off`` = destination stride, ``tag`` = source stride
 * (OP_STRIDED jobs only). The job runs on the same pool, guards and completion as every other.
 */
#include "kvx_native.h"

/* Triplets [lo, hi) of an OP_STRIDED_CMA_* job: the pieces as iovecs, IOV_MAX per system call. */
static int strided_cma(job_t *j, size_t lo, size_t hi) {
    struct iovec liov[IOV_MAX], riov[IOV_MAX];
    const int w = j->op == OP_STRIDED_CMA_WRITE;
    const triplet_t *t = j->t;
    size_t i = lo;
    uint64_t k = 0; /* next piece of triplet i */
    while (i < hi) {
        if (atomic_load_explicit(&j->cancelled, memory_order_relaxed)) return ECANCELED;
        size_t n = 0;
        ssize_t want = 0;
        while (i < hi && n < IOV_MAX) {
            const triplet_t *x = &t[i];
            const uintptr_t d = (uintptr_t)(x->dst + k * x->off), s = (uintptr_t)(x->src + k * (uint64_t)x->tag);
            liov[n].iov_base = (void *)(w ? s : d); /* the local side */
            riov[n].iov_base = (void *)(w ? d : s); /* the side in process pid */
            liov[n].iov_len = riov[n].iov_len = x->len;
            want += (ssize_t)x->len;
            n++;
            if (++k == (uint64_t)x->fd) { k = 0; i++; }
        }
        ssize_t got = w ? process_vm_writev(j->pid, liov, n, riov, n, 0) : process_vm_readv(j->pid, liov, n, riov, n, 0);
        if (got < 0) return errno ? errno : EIO;
        if (got != want) return EFAULT; /* a piece the target does not map: the whole job fails */
    }
    return 0;
}

/* Copy triplets [lo, hi) of an OP_STRIDED* job. */
int strided_range(job_t *j, size_t lo, size_t hi) {
    if (j->op != OP_STRIDED) return strided_cma(j, lo, hi);
    const triplet_t *t = j->t;
    for (size_t i = lo; i < hi; i++) {
        if ((i & 63) == 0 && atomic_load_explicit(&j->cancelled, memory_order_relaxed)) return ECANCELED;
        const uint64_t n = (uint64_t)t[i].fd, len = t[i].len, ds = t[i].off, ss = (uint64_t)t[i].tag;
        uintptr_t d = (uintptr_t)t[i].dst, s = (uintptr_t)t[i].src;
        for (uint64_t k = 0; k < n; k++, d += ds, s += ss) memcpy((void *)d, (const void *)s, len);
    }
    return 0;
}

/* A C-contiguous int64 (or uint64 below 2**63) index vector; 0 or -1 with an exception set. */
static int get_index(PyObject *o, Py_buffer *b, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    int sg = 0;
    if (int_buffer_width(b, &sg) != 8) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous 64-bit integer array", what);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* An optional per-descriptor uint64 array (None: absent) as long as ``n`` values. */
static int get_opt(PyObject *o, Py_buffer *b, int *have, Py_ssize_t n, const char *what) {
    *have = 0;
    if (o == Py_None) return 0;
    if (get_u64(o, b, what) < 0) return -1;
    *have = 1;
    if (b->len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "%s must hold one value per descriptor", what);
        PyBuffer_Release(b);
        *have = 0;
        return -1;
    }
    return 0;
}

/* submit_strided(code, pid, dst_addr, dst_len, dst_count, dst_stride, dst_idx, src_addr, src_len, src_count,
 *                src_stride, src_idx, guards, nthreads, inline_bytes)
 * A job over descriptor pairs (dst_idx[i], src_idx[i]) by memcpy (code OP_MEMCPY), process_vm_writev
 * (OP_CMA_WRITE: dst in process pid) or process_vm_readv (OP_CMA_READ: src in process pid); counts and
 * strides may be None (a plain side: count 1). Each pair must agree in len and count. Returns the byte
 * count (ran inline) or a Job. */
PyObject *py_submit_strided(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *da, *dl, *dc, *dst_, *di, *sa, *sl, *sc, *sst, *si, *guards_o;
    int code, nthreads;
    long long pid;
    unsigned long long inline_bytes;
    if (!PyArg_ParseTuple(args, "iLOOOOOOOOOOOiK", &code, &pid, &da, &dl, &dc, &dst_, &di, &sa, &sl, &sc, &sst, &si,
                          &guards_o, &nthreads, &inline_bytes))
        return NULL;
    if ((code != OP_MEMCPY && code != OP_CMA_WRITE && code != OP_CMA_READ) || (code != OP_MEMCPY && pid <= 0)) {
        PyErr_SetString(PyExc_ValueError, "bad op (memcpy, or CMA with a process id)");
        return NULL;
    }
    Py_buffer b[11];
    int have[11] = {0};
    PyObject *ret = NULL;
    job_t *j = NULL;
    /* 0 da, 1 dl, 2 dc, 3 ds, 4 di, 5 sa, 6 sl, 7 sc, 8 ss, 9 si, 10 guards */
    if (get_u64(da, &b[0], "dst_addr") < 0) goto out;
    have[0] = 1;
    if (get_u64(sa, &b[5], "src_addr") < 0) goto out;
    have[5] = 1;
    const Py_ssize_t nd = b[0].len / 8, ns = b[5].len / 8;
    if (get_opt(dl, &b[1], &have[1], nd, "dst_len") < 0 || get_opt(dc, &b[2], &have[2], nd, "dst_count") < 0
        || get_opt(dst_, &b[3], &have[3], nd, "dst_stride") < 0 || get_opt(sl, &b[6], &have[6], ns, "src_len") < 0
        || get_opt(sc, &b[7], &have[7], ns, "src_count") < 0 || get_opt(sst, &b[8], &have[8], ns, "src_stride") < 0)
        goto out;
    if (!have[1] || !have[6] || have[2] != have[3] || have[7] != have[8]) {
        PyErr_SetString(PyExc_ValueError, "lengths are required; a count needs its stride");
        goto out;
    }
    if (get_index(di, &b[4], "dst_idx") < 0) goto out;
    have[4] = 1;
    if (get_index(si, &b[9], "src_idx") < 0) goto out;
    have[9] = 1;
    if (guards_o != Py_None) {
        if (get_u64(guards_o, &b[10], "guards") < 0) goto out;
        have[10] = 1;
        if (b[10].len % 24) { PyErr_SetString(PyExc_ValueError, "guards must be (state, expected, inflight) triples"); goto out; }
    }
    const Py_ssize_t n = b[4].len / 8;
    if (b[9].len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "index lists differ in length (%zd vs %zd)", n, (Py_ssize_t)(b[9].len / 8));
        goto out;
    }
    const uint64_t *pda = b[0].buf, *pdl = b[1].buf, *pdc = have[2] ? b[2].buf : NULL, *pds = have[3] ? b[3].buf : NULL;
    const uint64_t *psa = b[5].buf, *psl = b[6].buf, *psc = have[7] ? b[7].buf : NULL, *pss = have[8] ? b[8].buf : NULL;
    const int64_t *pdi = b[4].buf, *psi = b[9].buf;
    j = calloc(1, sizeof(job_t));
    if (!j) { PyErr_NoMemory(); goto out; }
    j->t = malloc((n ? (size_t)n : 1) * sizeof(triplet_t));
    if (!j->t) { PyErr_NoMemory(); goto out; }
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t a = pdi[i], c = psi[i];
        if (a < 0 || a >= nd) { PyErr_Format(PyExc_IndexError, "destination index %lld out of range (list of %zd)", (long long)a, nd); goto out; }
        if (c < 0 || c >= ns) { PyErr_Format(PyExc_IndexError, "source index %lld out of range (list of %zd)", (long long)c, ns); goto out; }
        const uint64_t cnt = pdc ? pdc[a] : 1, scnt = psc ? psc[c] : 1;
        if (pdl[a] != psl[c] || cnt != scnt) {
            PyErr_Format(PyExc_ValueError, "descriptors differ at position %zd (%llu x %llu vs %llu x %llu bytes)", i,
                         (unsigned long long)cnt, (unsigned long long)pdl[a], (unsigned long long)scnt,
                         (unsigned long long)psl[c]);
            goto out;
        }
        triplet_t *x = &j->t[i];
        x->dst = pda[a];
        x->src = psa[c];
        x->len = pdl[a];
        x->fd = (int64_t)cnt;
        x->off = pds ? pds[a] : 0;
        x->tag = (int64_t)(pss ? pss[c] : 0);
        total += cnt * pdl[a]; /* each descriptor's span was bounded (2**62) when its list was checked */
    }
    j->nt = (size_t)n;
    j->nbytes = total;
    j->op = code == OP_MEMCPY ? OP_STRIDED : code == OP_CMA_WRITE ? OP_STRIDED_CMA_WRITE : OP_STRIDED_CMA_READ;
    j->pid = (pid_t)pid;
    if (have[10]) {
        size_t ng = (size_t)(b[10].len / 24);
        j->g = malloc((ng ? ng : 1) * sizeof(guard_t));
        if (!j->g) { PyErr_NoMemory(); goto out; }
        const uint64_t *pg = b[10].buf;
        for (size_t k = 0; k < ng; k++) {
            j->g[k].state = (_Atomic uint64_t *)(uintptr_t)pg[3 * k];
            j->g[k].expected = pg[3 * k + 1];
            j->g[k].inflight = (_Atomic uint32_t *)(uintptr_t)pg[3 * k + 2];
        }
        j->ng = ng;
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    ret = job_start(j, nthreads, inline_bytes, 1, NULL); /* consumes the job */
    j = NULL;
out:
    if (j) { free(j->t); free(j->g); free(j); }
    for (int k = 0; k < 11; k++)
        if (have[k]) PyBuffer_Release(&b[k]);
    return ret;
}
