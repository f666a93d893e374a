/* kvx._native, the Python side of copies: Job and Plan objects, submit/plan (descriptor arrays and
 * index lists checked and turned into a job), and the helpers for shared control pages. */
#include "kvx_native.h"

/* ------------------------------------------------------------------------------------------ */
/* Python side */

typedef struct {
    PyObject_HEAD
    job_t *job;
    PyObject *dig_out; /* where the job's digests go once it is seen done (or NULL) */
} JobObject;

/* Write a finished job's digests into out[t.tag] (a writable 64-bit integer buffer, GIL held). */
static int dig_scatter(job_t *j, PyObject *out) {
    Py_buffer b;
    if (PyObject_GetBuffer(out, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    int sg;
    if (int_buffer_width(&b, &sg) != 8) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_TypeError, "digests must be a writable 64-bit integer array");
        return -1;
    }
    uint64_t *o = b.buf;
    const uint64_t n = (uint64_t)(b.len / 8);
    for (size_t i = 0; i < j->nt; i++) {
        const uint64_t tag = (uint64_t)j->t[i].tag;
        if (tag >= n) {
            PyBuffer_Release(&b);
            PyErr_SetString(PyExc_ValueError, "the digests array shrank under the job");
            return -1;
        }
        o[tag] = j->dig[i];
    }
    PyBuffer_Release(&b);
    return 0;
}

/* A job seen finished without error: hand its digests over, once. */
static int job_seen_done(JobObject *self) {
    if (!self->dig_out) return 0;
    PyObject *out = self->dig_out;
    self->dig_out = NULL;
    int r = dig_scatter(self->job, out);
    Py_DECREF(out);
    return r;
}


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
    if (job_seen_done(self) < 0) return NULL;
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
    if (job_seen_done(self) < 0) return NULL;
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
    Py_CLEAR(self->dig_out);
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

PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvx._native.Job",
    .tp_basicsize = sizeof(JobObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Job_dealloc,
    .tp_methods = Job_methods,
    .tp_getset = Job_getset,
    .tp_doc = "A batched copy running on the native pool.",
};

static void job_free(job_t *j) {
    free(j->t); free(j->g); free(j->dig); pthread_mutex_destroy(&j->mu); pthread_cond_destroy(&j->cv); free(j);
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
PyObject *job_start(job_t *j, int nthreads, unsigned long long inline_bytes, int owned, PyObject *dig_out) {
    uint64_t total = j->nbytes;
    int ge = guards_enter(j->g, j->ng);
    if (ge) {
        if (owned) job_free(j);
        return raise_errno(ge);
    }
    if (total <= inline_bytes) {
        int e = run_inline(j);
        int se = (!e && dig_out) ? dig_scatter(j, dig_out) : 0;
        if (owned) job_free(j);
        if (e) return raise_errno(e);
        if (se < 0) return NULL;
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
    /* (not with digests: they are per descriptor) */
    if ((j->op == OP_MEMCPY || j->op == OP_MMWRITE || j->op == OP_MMREAD) && !j->dig && j->nt < (size_t)nthreads * 4) {
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
    jo->dig_out = dig_out;
    Py_XINCREF(dig_out);
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
    pool_push(first, last);
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
    return job_start(self->tpl, self->nthreads, self->inline_bytes, 0, NULL);
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

PyTypeObject PlanType = {
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
int int_buffer_width(const Py_buffer *b, int *is_signed) {
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
PyObject *seq_item(PyObject *seq, Py_ssize_t i) {
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
 *        nthreads, inline_bytes, sync[, file_off]) -> Job | None
 *
 * dst_* and src_*: uint64 arrays of a prepared list (address or file offset, length);
 * *_idx: indices into them (list, int, or int64 array). fds: int64 array parallel to the FILE
 * side's descriptors (or None). guards: uint64 array of (state_ptr, expected, inflight_ptr)
 * triples or None. file_off: the file offsets of the mapped side, a uint64 array parallel to it:
 * OP_MMWRITE (optional) dst_addr, runs whose pages are not in the page cache then go through
 * pwritev; OP_MMREAD (required, with fds) src_addr, for the preadv of runs not in the page cache.
 * Returns None when the job ran inline and succeeded.
 */
static PyObject *submit_impl(PyObject *args, int as_plan) {
    int op, nthreads, sync;
    long long pid;
    unsigned long long inline_bytes;
    PyObject *da, *dl, *di, *sa, *sl, *si, *fds_o, *guards_o, *off_o = Py_None, *dig_o = Py_None;
    if (!PyArg_ParseTuple(args, "iLOOOOOOOOiKi|OO", &op, &pid, &da, &dl, &di, &sa, &sl, &si, &fds_o, &guards_o,
                          &nthreads, &inline_bytes, &sync, &off_o, &dig_o))
        return NULL;
    const int want_dig = dig_o != Py_None;
    if (want_dig && (as_plan || op == OP_MEMCPY || op == OP_CMA_WRITE || op == OP_CMA_READ)) {
        PyErr_SetString(PyExc_ValueError, "digests are taken by file jobs only, and not by plans");
        return NULL;
    }
    if (op < OP_MEMCPY || op > OP_MMREAD) {
        PyErr_SetString(PyExc_ValueError, "bad op");
        return NULL;
    }
    if (op == OP_MMWRITE || op == OP_MMREAD) {
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
    if (op == OP_MMREAD && (off_o == Py_None || !have_fd)) {
        PyErr_SetString(PyExc_ValueError, "OP_MMREAD needs the descriptors and file offsets of its sources");
        goto e8;
    }
    if (have_fd && bfd.len != ((op == OP_PWRITE || op == OP_MMWRITE) ? bda.len : bsa.len)) {
        PyErr_SetString(PyExc_ValueError, "fds must be as long as the file side's descriptor list");
        goto e8;
    }
    if (off_o != Py_None) {
        if (op != OP_MMWRITE && op != OP_MMREAD) {
            PyErr_SetString(PyExc_ValueError, "file_off is for OP_MMWRITE and OP_MMREAD only");
            goto e8;
        }
        if (get_u64(off_o, &boff, "file_off") < 0) goto e8;
        have_off = 1;
        if (boff.len / 8 != (op == OP_MMREAD ? ns : nd)) {
            PyErr_SetString(PyExc_ValueError, op == OP_MMREAD ? "file_off must be as long as src_addr"
                                                              : "file_off must be as long as dst_addr");
            goto e8;
        }
    }
    const int mem_is_dst = op == OP_PREAD || op == OP_MMREAD;
    if (want_dig) {
        Py_buffer bdig;
        if (PyObject_GetBuffer(dig_o, &bdig, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto e8;
        int sg;
        const int w = int_buffer_width(&bdig, &sg);
        const Py_ssize_t have = bdig.len / 8;
        PyBuffer_Release(&bdig);
        if (w != 8) { PyErr_SetString(PyExc_TypeError, "digests must be a writable 64-bit integer array"); goto e8; }
        if (have < (mem_is_dst ? nd : ns)) {
            PyErr_Format(PyExc_ValueError, "digests has %zd entries; the memory side lists %zd", have,
                         mem_is_dst ? nd : ns);
            goto e8;
        }
    }
    const uint64_t *poff = have_off ? boff.buf : NULL;
    const uint64_t *pda = bda.buf, *pdl = bdl.buf, *psa = bsa.buf, *psl = bsl.buf;
    const int64_t *pfd = have_fd ? bfd.buf : NULL;
    /* small posts (the latency path) build their job on the stack: no allocation at all */
    job_t sjob;
    triplet_t strip[SMALL_N];
    guard_t sguard[SMALL_N];
    size_t ngu = have_g ? (size_t)(bg.len / 24) : 0;
    int on_stack = !as_plan && !want_dig && n <= SMALL_N && ngu <= SMALL_N;
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
        x->off = poff ? poff[op == OP_MMREAD ? b : a] : 0;
        x->tag = mem_is_dst ? a : b;
        total += x->len;
    }
    j->nt = (size_t)n;
    j->nbytes = total;
    j->op = op;
    j->pid = (pid_t)pid;
    j->sync = sync;
    j->has_off = have_off;
    if (want_dig) {
        j->dig = calloc(j->nt ? j->nt : 1, sizeof(uint64_t));
        if (!j->dig) { PyErr_NoMemory(); goto e9; }
    }
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
        ret = job_start(j, nthreads, inline_bytes, 1, dig_o == Py_None ? NULL : dig_o);
    }
    j = NULL;
    goto e8;
e9:
    if (j && !on_stack) { free(j->t); free(j->g); free(j->dig); free(j); }
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

PyObject *py_submit(PyObject *self, PyObject *args) {
    (void)self;
    return submit_impl(args, 0);
}

PyObject *py_plan(PyObject *self, PyObject *args) {
    (void)self;
    return submit_impl(args, 1);
}

/* map_fd(fd, size, offset, writable) -> address */
PyObject *py_map_fd(PyObject *self, PyObject *args) {
    (void)self;
    int fd, writable;
    unsigned long long size, off;
    if (!PyArg_ParseTuple(args, "iKKp", &fd, &size, &off, &writable)) return NULL;
    void *p = mmap(NULL, size, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, (off_t)off);
    if (p == MAP_FAILED) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)p);
}

PyObject *py_unmap(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long addr, size;
    if (!PyArg_ParseTuple(args, "KK", &addr, &size)) return NULL;
    if (munmap((void *)(uintptr_t)addr, size) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}


/* store64(addr, value) / load64(addr) / load32(addr): atomic accesses to shared control pages */
PyObject *py_store64(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long addr, v;
    if (!PyArg_ParseTuple(args, "KK", &addr, &v)) return NULL;
    atomic_store((_Atomic uint64_t *)(uintptr_t)addr, (uint64_t)v);
    Py_RETURN_NONE;
}

PyObject *py_load64(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(atomic_load((_Atomic uint64_t *)(uintptr_t)addr));
}

PyObject *py_load32(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLong(atomic_load((_Atomic uint32_t *)(uintptr_t)addr));
}

/* drain(addrs: uint64 array of inflight counters, timeout) -> True if all reached zero */
PyObject *py_drain(PyObject *self, PyObject *args) {
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

PyObject *py_cma_probe(PyObject *self, PyObject *args) {
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
