/*
 * kvx._net: vectored socket I/O for the tcp backend, with the GIL released.
 *
 * The tcp backend moves descriptor lists straight between registered memory and the socket:
 * the kernel gathers from (sendmsg) and scatters into (recvmsg) an iovec per descriptor, so a
 * transfer costs the same copies as a raw TCP stream and Python never loops over descriptors.
 *
 * Every call is bounded: it fails with ETIMEDOUT when the socket makes no progress for
 * ``timeout`` seconds. Sockets are expected in non-blocking mode; readiness is awaited with
 * poll(). Another thread may shutdown() the socket to wake a blocked call (it then fails).
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "kvx_buf.h"
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define BATCH 1024 /* iovecs per syscall (IOV_MAX on Linux) */
/* Receives that hash (recvv's ``digests``) ask for at most this many bytes per recvmsg (at least
 * one descriptor), so each block is hashed right after the kernel copied it, while it is in L2. */
#define HASH_WINDOW (512u << 10)

/* kvx_hash.c (linked into this module too): the kvx-nh64 of n bytes (dst NULL: hash only) */
uint64_t copy_hash(void *dst, const void *src, size_t n, int stream);

static int wait_fd(int fd, short ev, double timeout) {
    struct pollfd p = {.fd = fd, .events = ev, .revents = 0};
    int ms = timeout < 0 ? -1 : (int)(timeout * 1000.0 + 0.5);
    for (;;) {
        int r = poll(&p, 1, ms);
        if (r > 0) return 0; /* readable/writable or error/hangup: the syscall will tell */
        if (r == 0) return ETIMEDOUT;
        if (errno != EINTR) return errno;
    }
}

/* Send iov[0..n) fully. Returns 0 or an errno. The iov array is modified. */
static int send_iov(int fd, struct iovec *iov, size_t n, double timeout) {
    size_t i = 0;
    while (i < n) {
        if (iov[i].iov_len == 0) { i++; continue; }
        struct msghdr m;
        memset(&m, 0, sizeof(m));
        m.msg_iov = iov + i;
        m.msg_iovlen = n - i > BATCH ? BATCH : n - i;
        ssize_t r = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int e = wait_fd(fd, POLLOUT, timeout);
                if (e) return e;
                continue;
            }
            return errno;
        }
        size_t left = (size_t)r;
        while (left && i < n) {
            if (left >= iov[i].iov_len) { left -= iov[i].iov_len; i++; }
            else { iov[i].iov_base = (char *)iov[i].iov_base + left; iov[i].iov_len -= left; left = 0; }
        }
    }
    return 0;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/*
 * Large receives (``lowat_max`` > 1): ask the kernel to wake us only once min(left, lowat_max)
 * bytes are queued (SO_RCVLOWAT),
 * so a bulk receiver copies out in big batches instead of waking per segment (each wakeup is
 * a context switch, and an IPI in a VM). Set only while at least lowat_max/2 is still expected;
 * restored to 1 before returning so frame reads see every byte.
 */

/*
 * Receive into iov[0..n) fully. *got counts bytes received. Returns 0, an errno, -1 on EOF,
 * -2 when ``idle`` >= 0 seconds passed with nothing received (idle < 0: no idle exit).
 * ``spin`` > 0: on EAGAIN retry for up to that many seconds before sleeping in poll (small,
 * latency-bound transfers: no wakeup when the reply comes within the spin).
 */
/*
 * ``dig`` (NULL: no hashing): once descriptor j is complete, dig[j] = kvx-nh64 of its n bytes at
 * ``base[j]`` (the iovecs' start addresses before the call; iov is modified). A descriptor whose
 * bytes did not all arrive (an error return) gets no digest.
 */
static int recv_iov3(int fd, struct iovec *iov, size_t n, double timeout, double idle, double spin,
                     long lowat_max, uint64_t *got, void *const *base, const size_t *len, uint64_t *dig) {
    size_t i = 0, hashed = 0;
    uint64_t want = 0;
    int lowat = 1, e = 0;
    double spin_end = 0.0;
    for (size_t j = 0; j < n; j++) want += iov[j].iov_len;
    *got = 0;
    while (i < n) {
        if (dig) {
            for (; hashed < i; hashed++) dig[hashed] = copy_hash(NULL, base[hashed], len[hashed], 0);
        }
        if (iov[i].iov_len == 0) { i++; continue; }
        struct msghdr m;
        memset(&m, 0, sizeof(m));
        m.msg_iov = iov + i;
        m.msg_iovlen = n - i > BATCH ? BATCH : n - i;
        if (dig) { /* a window of whole descriptors (at least one) */
            size_t k = 1, bytes = iov[i].iov_len;
            while (k < m.msg_iovlen && bytes + iov[i + k].iov_len <= HASH_WINDOW) bytes += iov[i + k++].iov_len;
            m.msg_iovlen = k;
        }
        ssize_t r = recvmsg(fd, &m, MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (spin > 0) {
                    double t = now_s();
                    if (spin_end == 0.0) spin_end = t + spin;
                    if (t < spin_end) { sched_yield(); continue; } /* yield: let a runnable peer go first */
                }
                uint64_t left = want - *got;
                int lw = (lowat_max > 1 && left >= (uint64_t)lowat_max / 2)
                             ? (int)(left > (uint64_t)lowat_max ? (uint64_t)lowat_max : left) : 1;
                if (lw != lowat && setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &lw, sizeof(lw)) == 0) lowat = lw;
                if (*got == 0 && idle >= 0) {
                    e = idle > 0 ? wait_fd(fd, POLLIN, idle) : ETIMEDOUT;
                    if (e == ETIMEDOUT) { e = -2; break; }
                } else {
                    e = wait_fd(fd, POLLIN, timeout);
                }
                if (e) break;
                continue;
            }
            e = errno;
            break;
        }
        if (r == 0) { e = -1; break; }
        *got += (uint64_t)r;
        size_t left = (size_t)r;
        while (left && i < n) {
            if (left >= iov[i].iov_len) { left -= iov[i].iov_len; i++; }
            else { iov[i].iov_base = (char *)iov[i].iov_base + left; iov[i].iov_len -= left; left = 0; }
        }
    }
    if (dig && !e) {
        for (; hashed < n; hashed++) dig[hashed] = copy_hash(NULL, base[hashed], len[hashed], 0);
    }
    if (lowat != 1) {
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof(one));
    }
    return e;
}

static int recv_iov2(int fd, struct iovec *iov, size_t n, double timeout, double idle, double spin,
                     long lowat_max, uint64_t *got) {
    return recv_iov3(fd, iov, n, timeout, idle, spin, lowat_max, got, NULL, NULL, NULL);
}

/* The original contract: ``idle`` > 0 allows an idle exit, 0 means none. */
static int recv_iov(int fd, struct iovec *iov, size_t n, double timeout, double idle, uint64_t *got) {
    return recv_iov2(fd, iov, n, timeout, idle > 0 ? idle : -1.0, 0.0, 0, got);
}

static PyObject *raise_err(int e) {
    if (e == -1) {
        errno = ECONNRESET;
        return PyErr_Format(PyExc_ConnectionResetError, "connection closed by peer in the middle of a message");
    }
    errno = e;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* build iovecs: optional head buffer, then (addr[i], nbytes[i]) */
static struct iovec *build(Py_buffer *head, Py_buffer *ba, Py_buffer *bl, size_t *n_out) {
    size_t nd = ba ? (size_t)(ba->len / 8) : 0;
    size_t n = nd + (head ? 1 : 0);
    struct iovec *iov = malloc((n ? n : 1) * sizeof(struct iovec));
    if (!iov) return NULL;
    size_t k = 0;
    if (head) { iov[k].iov_base = head->buf; iov[k].iov_len = (size_t)head->len; k++; }
    if (nd) {
        const uint64_t *a = ba->buf, *l = bl->buf;
        for (size_t i = 0; i < nd; i++, k++) { iov[k].iov_base = (void *)(uintptr_t)a[i]; iov[k].iov_len = (size_t)l[i]; }
    }
    *n_out = n;
    return iov;
}

/* sendv(fd, head: bytes-like | None, addr: u64 | None, nbytes: u64 | None, timeout) -> None */
static PyObject *py_sendv(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    PyObject *ho, *ao, *lo;
    double timeout;
    if (!PyArg_ParseTuple(args, "iOOOd", &fd, &ho, &ao, &lo, &timeout)) return NULL;
    Py_buffer bh, ba, bl;
    int hh = 0, ha = 0;
    if (ho != Py_None) { if (PyObject_GetBuffer(ho, &bh, PyBUF_C_CONTIGUOUS) < 0) return NULL; hh = 1; }
    if (ao != Py_None) {
        if (get_u64(ao, &ba, "addr") < 0) goto fail0;
        if (get_u64(lo, &bl, "nbytes") < 0) { PyBuffer_Release(&ba); goto fail0; }
        if (ba.len != bl.len) {
            PyErr_SetString(PyExc_ValueError, "addr and nbytes differ in length");
            PyBuffer_Release(&ba); PyBuffer_Release(&bl); goto fail0;
        }
        ha = 1;
    }
    size_t n;
    struct iovec *iov = build(hh ? &bh : NULL, ha ? &ba : NULL, ha ? &bl : NULL, &n);
    int e = 0;
    if (!iov) { PyErr_NoMemory(); goto fail1; }
    Py_BEGIN_ALLOW_THREADS
    e = send_iov(fd, iov, n, timeout);
    Py_END_ALLOW_THREADS
    free(iov);
    if (ha) { PyBuffer_Release(&ba); PyBuffer_Release(&bl); }
    if (hh) PyBuffer_Release(&bh);
    if (e) return raise_err(e);
    Py_RETURN_NONE;
fail1:
    if (ha) { PyBuffer_Release(&ba); PyBuffer_Release(&bl); }
fail0:
    if (hh) PyBuffer_Release(&bh);
    return NULL;
}

/*
 * recvv(fd, addr: u64, nbytes: u64, timeout, spin=0, lowat=0, digests=None) -> None: fill every
 * descriptor, in order. ``digests``: a writable uint64 buffer of one row per descriptor, which
 * receives the kvx-nh64 of each descriptor's bytes, taken right after they landed (the rows are
 * complete only when the call returns without an exception).
 */
static PyObject *py_recvv(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    PyObject *ao, *lo, *dobj = Py_None;
    double timeout, spin = 0.0;
    long lowat = 0;
    if (!PyArg_ParseTuple(args, "iOOd|dlO", &fd, &ao, &lo, &timeout, &spin, &lowat, &dobj)) return NULL;
    Py_buffer ba, bl, bd;
    int hd = 0;
    if (get_u64(ao, &ba, "addr") < 0) return NULL;
    if (get_u64(lo, &bl, "nbytes") < 0) { PyBuffer_Release(&ba); return NULL; }
    if (ba.len != bl.len) {
        PyErr_SetString(PyExc_ValueError, "addr and nbytes differ in length");
        PyBuffer_Release(&ba); PyBuffer_Release(&bl);
        return NULL;
    }
    if (dobj != Py_None) {
        if (PyObject_GetBuffer(dobj, &bd, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
            PyBuffer_Release(&ba); PyBuffer_Release(&bl);
            return NULL;
        }
        hd = 1;
        if (bd.len != ba.len) {
            PyErr_SetString(PyExc_ValueError, "digests must hold one uint64 per descriptor");
            PyBuffer_Release(&bd); PyBuffer_Release(&ba); PyBuffer_Release(&bl);
            return NULL;
        }
    }
    size_t n;
    struct iovec *iov = build(NULL, &ba, &bl, &n);
    void **base = NULL;
    size_t *len = NULL;
    int e = 0;
    uint64_t got = 0;
    if (iov && hd) {
        base = malloc((n ? n : 1) * sizeof(void *));
        len = malloc((n ? n : 1) * sizeof(size_t));
        for (size_t j = 0; base && len && j < n; j++) { base[j] = iov[j].iov_base; len[j] = iov[j].iov_len; }
    }
    if (!iov || (hd && (!base || !len))) {
        free(iov); free(base); free(len);
        if (hd) PyBuffer_Release(&bd);
        PyBuffer_Release(&ba); PyBuffer_Release(&bl);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    e = recv_iov3(fd, iov, n, timeout, -1.0, spin, lowat, &got, (void *const *)base, len,
                  hd ? (uint64_t *)bd.buf : NULL);
    Py_END_ALLOW_THREADS
    free(iov);
    free(base);
    free(len);
    if (hd) PyBuffer_Release(&bd);
    PyBuffer_Release(&ba);
    PyBuffer_Release(&bl);
    if (e) return raise_err(e);
    Py_RETURN_NONE;
}

/*
 * recv_into(fd, buf, timeout, idle) -> int: fill ``buf`` exactly.
 * Returns len(buf); 0 on a clean EOF before the first byte; -1 when ``idle`` > 0 seconds passed
 * with nothing received (the caller checks its state and calls again).
 */
static PyObject *py_recv_into(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    Py_buffer b;
    double timeout, idle;
    if (!PyArg_ParseTuple(args, "iw*dd", &fd, &b, &timeout, &idle)) return NULL;
    struct iovec iov = {.iov_base = b.buf, .iov_len = (size_t)b.len};
    uint64_t got = 0;
    int e;
    Py_BEGIN_ALLOW_THREADS
    e = recv_iov(fd, &iov, 1, timeout, idle, &got);
    Py_END_ALLOW_THREADS
    Py_ssize_t len = b.len;
    PyBuffer_Release(&b);
    if (e == -2) return PyLong_FromLong(-1);
    if (e == -1 && got == 0) return PyLong_FromLong(0);
    if (e) return raise_err(e);
    return PyLong_FromSsize_t(len);
}

/* discard(fd, n, timeout) -> None: read and drop n bytes (a refused write's payload) */
static PyObject *py_discard(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    unsigned long long n;
    double timeout;
    if (!PyArg_ParseTuple(args, "iKd", &fd, &n, &timeout)) return NULL;
    const size_t cap = 1 << 20;
    char *buf = malloc(cap);
    if (!buf) return PyErr_NoMemory();
    int e = 0;
    Py_BEGIN_ALLOW_THREADS
    while (n && !e) {
        size_t k = n > cap ? cap : (size_t)n;
        struct iovec iov = {.iov_base = buf, .iov_len = k};
        uint64_t got = 0;
        e = recv_iov(fd, &iov, 1, timeout, 0.0, &got);
        n -= k;
    }
    Py_END_ALLOW_THREADS
    free(buf);
    if (e) return raise_err(e);
    Py_RETURN_NONE;
}

/*
 * recv_frame(fd, max_bytes, timeout, idle, spin) -> bytes | int: read one frame (8-byte header
 * "KX", kind 1 little-endian, u32 length; then the body) and return its body.
 * Returns 0 on a clean EOF before the first byte, -1 when nothing arrived within ``idle``
 * seconds (``idle`` < 0: wait up to ``timeout`` of no progress; 0: just try). Raises
 * ValueError on a bad header or a body over ``max_bytes``. ``spin``: see recv_iov2.
 */
static PyObject *py_recv_frame(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    unsigned long long maxb;
    double timeout, idle, spin;
    if (!PyArg_ParseTuple(args, "iKddd", &fd, &maxb, &timeout, &idle, &spin)) return NULL;
    unsigned char h[8];
    struct iovec iov = {.iov_base = h, .iov_len = 8};
    uint64_t got = 0;
    int e;
    Py_BEGIN_ALLOW_THREADS
    e = recv_iov2(fd, &iov, 1, timeout, idle, spin, 0, &got);
    Py_END_ALLOW_THREADS
    if (e == -2) return PyLong_FromLong(-1);
    if (e == -1 && got == 0) return PyLong_FromLong(0);
    if (e) return raise_err(e);
    if (h[0] != 'K' || h[1] != 'X' || h[2] != 1 || h[3] != 0) {
        PyErr_SetString(PyExc_ValueError, "bad frame header");
        return NULL;
    }
    uint32_t len = (uint32_t)h[4] | ((uint32_t)h[5] << 8) | ((uint32_t)h[6] << 16) | ((uint32_t)h[7] << 24);
    if ((unsigned long long)len > maxb) {
        PyErr_Format(PyExc_ValueError, "frame of %u bytes exceeds the limit of %llu", len, maxb);
        return NULL;
    }
    PyObject *body = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
    if (!body) return NULL;
    if (len) {
        iov.iov_base = PyBytes_AS_STRING(body);
        iov.iov_len = len;
        Py_BEGIN_ALLOW_THREADS
        e = recv_iov2(fd, &iov, 1, timeout, -1.0, spin, 0, &got);
        Py_END_ALLOW_THREADS
        if (e) { Py_DECREF(body); return raise_err(e); }
    }
    return body;
}

static PyMethodDef methods[] = {
    {"recv_frame", py_recv_frame, METH_VARARGS,
     "recv_frame(fd, max_bytes, timeout, idle, spin) -> body bytes, 0 on EOF, -1 when idle."},
    {"sendv", py_sendv, METH_VARARGS, "sendv(fd, head, addr, nbytes, timeout): send head then every descriptor."},
    {"recvv", py_recvv, METH_VARARGS, "recvv(fd, addr, nbytes, timeout, spin=0, lowat=0, digests=None): receive into every descriptor "
     "(and kvx-nh64 each into digests)."},
    {"recv_into", py_recv_into, METH_VARARGS, "recv_into(fd, buf, timeout, idle) -> n, 0 on EOF, -1 when idle."},
    {"discard", py_discard, METH_VARARGS, "discard(fd, n, timeout): read and drop n bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "kvx._net", "Vectored socket I/O for the tcp backend.", -1,
                                 methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__net(void) { return PyModule_Create(&mod); }
