/*
 * kvx._ucx: the native half of the ucx backend, on UCX's UCP API (UCX 1.22 from the libucx wheels).
 *
 * One Worker object owns a UCP context, one worker, its endpoints and a progress thread:
 *
 * - post() issues a whole transfer's index list in one call: one ucp_put_nbx/ucp_get_nbx per
 *   descriptor pair (local memh and remote rkey per descriptor, UCP_OP_ATTR_FLAG_MULTI_SEND;
 *   each request freed by its completion callback, which also marks the endpoint's progress
 *   for the peer_timeout watchdog), then one ucp_ep_flush_nbx whose completion means
 *   every operation before it completed remotely. The transfer is done when the flush is; a
 *   notification attached to it is sent (active message) from the flush callback, i.e. after
 *   the data landed.
 * - post_am() carries a HOST transfer as batched active messages (AM ids 1-4): write batches
 *   with the source blocks as an IOV payload, read requests answered with the blocks' bytes; the
 *   target validates every entry (cookie of an authenticated peer, live registration of the
 *   stated generation, bounds, no overlapping destinations, payload length) before it copies a
 *   byte, and answers each batch; the transfer is done when every batch is answered.
 * - Progress: a thread that runs ucp_worker_progress under the worker lock, arms the worker
 *   (ucp_worker_arm) and sleeps in epoll on the worker's event fd plus an eventfd for wakeups:
 *   no busy core when idle. A caller blocked in wait() progresses the worker itself while its
 *   transfer moves (as a NIXL initiator polls): the thread stands aside meanwhile, so the two
 *   do not take turns on the lock and the CPU; a waiter whose transfer makes no progress for
 *   WAIT_IDLE_S leaves the worker to the thread and sleeps until the transfer ends.
 * - Failure: endpoints use UCP_ERR_HANDLING_MODE_PEER; the error callback marks the endpoint
 *   failed and the progress thread force-closes it, which completes its pending operations with
 *   an error. An endpoint with pending work that completes nothing for ``peer_timeout`` seconds
 *   is failed the same way (a cut link): every wait is bounded.
 * - Active messages (id 0) carry control messages and notifications; they are copied into a
 *   queue that the Python side drains with am_recv(timeout).
 *
 * All UCX calls happen under the worker lock (the worker is created UCS_THREAD_MODE_SERIALIZED);
 * Python-facing calls that wait release the GIL.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>

#define MAX_EPS 4096
#define AM_ID 0
#define AM_MAX (16 << 20) /* largest control message accepted */
#define AM_QMAX 65536    /* most queued, undrained messages */
#define WAIT_IDLE_S 1e-3 /* a waiter progresses the worker itself until this long without progress */
/* batched active-message transfers (transports without real RMA: tcp, shared-memory mm) */
#define AM_WREQ 1        /* write batch: header am_hdr + entries, payload the blocks' bytes */
#define AM_ACK 2         /* a batch's answer: am_ack (data) */
#define AM_RREQ 3        /* read batch request: header am_hdr + entries, no payload */
#define AM_RDATA 4       /* a read batch's answer: header am_ack, payload the blocks' bytes */
#define NREG (1 << 16)   /* registration slots (kvx._slots.MAX_SLOTS) */
#define AM_BATCH_MAX (64 << 20) /* the most bytes one batch may carry (a target refuses more) */
#define AM_ENT_MAX 65536 /* the most entries one batch may list */
#define MAX_COOKIES 4096

static PyObject *UcxError;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void abs_deadline(struct timespec *ts, double timeout) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    if (timeout < 0) timeout = 0;
    if (timeout > 1e6) timeout = 1e6;
    time_t s = (time_t)timeout;
    long ns = (long)((timeout - (double)s) * 1e9);
    ts->tv_sec += s;
    ts->tv_nsec += ns;
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}

/* ---- types ------------------------------------------------------------------------------- */
typedef struct kep {
    ucp_ep_h ep;
    int id;
    int peer_errors;     /* created with UCP_ERR_HANDLING_MODE_PEER */
    int failed;          /* error seen: no new work; force-close pending */
    int closed;          /* ucp_ep_close done */
    ucs_status_t status; /* why it failed */
    long pending;        /* transfers (flushes) in flight */
    double last;         /* last completion or post with pending work */
} kep;

typedef struct amsg {
    struct amsg *next;
    size_t len;
    char data[];
} amsg;

typedef struct xfer {
    int refs;            /* Python object + in-flight flush */
    int done;
    ucs_status_t status;
    uint64_t nbytes;
    kep *ep;
    struct kworker *w;
    char *notif;         /* sent when the flush completes */
    size_t notif_len;
    /* batched active messages (am=1): done when every batch is acknowledged */
    int am;
    int rd;              /* a read: batches land in the local blocks below */
    uint64_t xid;
    uint32_t nbatch, left;
    uint8_t *bdone;      /* per batch: answered */
    uint32_t *bstart;    /* read: first entry of each batch (nbatch + 1) */
    uint64_t *bbytes;    /* read: bytes of each batch */
    uint64_t *laddr, *llen; /* read: local destination per entry */
    uint32_t *lslot, *lgen;
    struct xfer *anext, *aprev; /* the worker's in-flight list */
} xfer;

typedef struct { uint64_t addr, len; uint32_t slot, gen; } am_ent; /* one remote block */
typedef struct { uint64_t cookie, xid; uint32_t batch, n; } am_hdr;
typedef struct { uint64_t xid; uint32_t batch; int32_t status; } am_ack;
typedef struct { uint64_t base, len; uint32_t gen; int live; } kreg;

typedef struct kworker {
    PyObject_HEAD
    ucp_context_h ctx;
    ucp_worker_h worker;
    pthread_mutex_t lk;
    pthread_cond_t cv;    /* a transfer finished */
    pthread_cond_t amcv;  /* a message arrived */
    pthread_cond_t idlecv; /* the last waiter stopped progressing the worker */
    int efd, wakefd, epfd;
    pthread_t thr;
    int thr_started;
    int stop;
    double peer_timeout;
    kep *eps[MAX_EPS];
    int eps_hi;           /* one past the highest slot of eps[] ever used (bounds the scans) */
    amsg *qhead, *qtail;
    long qlen;
    long dropped;
    int is_open;
    kreg *regs;           /* this agent's HOST registrations, for batched AM validation */
    uint64_t cookies[MAX_COOKIES]; /* authenticated peers' batch cookies (0: free) */
    int cookie_ep[MAX_COOKIES];    /* the endpoint back to each (answers go there) */
    xfer *ahead;          /* batched AM transfers in flight */
    uint64_t next_xid;
    size_t max_hdr;       /* UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER */
    long refused;         /* batches refused (validation) */
    long batches;         /* batches sent */
    int spinners;         /* waiters progressing the worker themselves (the thread stands aside) */
} kworker;

typedef struct {
    PyObject_HEAD
    xfer *x;
    PyObject *owner; /* the Worker */
} XferObject;

static PyTypeObject WorkerType;
static PyTypeObject XferType;

static PyObject *raise_ucs(ucs_status_t st, const char *what) {
    PyObject *args = Py_BuildValue("(is)", (int)st, what);
    if (args) {
        PyObject *msg = PyUnicode_FromFormat("%s: %s", what, ucs_status_string(st));
        PyObject *a2 = Py_BuildValue("(iO)", (int)st, msg ? msg : Py_None);
        Py_XDECREF(msg);
        if (a2) { PyErr_SetObject(UcxError, a2); Py_DECREF(a2); }
        Py_DECREF(args);
    }
    return NULL;
}

static void wake(kworker *w) {
    uint64_t one = 1;
    ssize_t r = write(w->wakefd, &one, sizeof(one));
    (void)r;
}

/* ---- transfers (under lk) ---------------------------------------------------------------- */
static void xfer_unref(xfer *x) {
    if (--x->refs == 0) {
        free(x->notif);
        free(x->bdone); free(x->bstart); free(x->bbytes);
        free(x->laddr); free(x->llen); free(x->lslot); free(x->lgen);
        free(x);
    }
}

static void send_cb(void *req, ucs_status_t st, void *user) {
    (void)st;
    free(user);
    ucp_request_free(req);
}

/* send an active message; the payload is copied; returns a status */
static ucs_status_t am_send_locked(kworker *w, kep *e, const void *data, size_t len) {
    if (e->failed || e->closed) return e->status != UCS_OK ? e->status : UCS_ERR_CONNECTION_RESET;
    char *copy = malloc(len ? len : 1);
    if (!copy) return UCS_ERR_NO_MEMORY;
    memcpy(copy, data, len);
    ucp_request_param_t prm;
    memset(&prm, 0, sizeof(prm));
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    prm.cb.send = send_cb;
    prm.user_data = copy;
    prm.flags = UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t r = ucp_am_send_nbx(e->ep, AM_ID, NULL, 0, copy, len, &prm);
    if (r == NULL) { free(copy); return UCS_OK; }
    if (UCS_PTR_IS_ERR(r)) { free(copy); return UCS_PTR_STATUS(r); }
    (void)w;
    return UCS_OK;
}

static void am_unlink(xfer *x);

static void finish(xfer *x, ucs_status_t st) {
    if (x->done) return;
    x->done = 1;
    x->status = st;
    if (x->am) am_unlink(x); /* drops the in-flight list's reference last */
    if (x->am && st == UCS_OK && x->notif) {
        ucs_status_t s2 = am_send_locked(x->w, x->ep, x->notif, x->notif_len);
        if (s2 != UCS_OK) x->status = s2;
        pthread_cond_broadcast(&x->w->cv);
        xfer_unref(x);
        return;
    }
    if (x->am) {
        pthread_cond_broadcast(&x->w->cv);
        xfer_unref(x);
        return;
    }
    if (st == UCS_OK && x->notif) {
        ucs_status_t s2 = am_send_locked(x->w, x->ep, x->notif, x->notif_len);
        if (s2 != UCS_OK) x->status = s2;
    }
    pthread_cond_broadcast(&x->w->cv);
}

static void flush_cb(void *req, ucs_status_t st, void *user) {
    xfer *x = user;
    kep *e = x->ep;
    e->pending--;
    e->last = now_s();
    if (st != UCS_OK && !e->failed) { e->failed = 1; e->status = st; }
    finish(x, st);
    xfer_unref(x);
    ucp_request_free(req);
}

/* one operation of a transfer completed: the endpoint made progress */
static void op_cb(void *req, ucs_status_t st, void *user) {
    kep *e = user;
    (void)st;
    e->last = now_s();
    ucp_request_free(req);
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t st) {
    kep *e = arg;
    (void)ep;
    if (!e->failed) { e->failed = 1; e->status = st; }
}

/* force-close failed endpoints (pending flushes complete with an error), under lk */
static int reap_failed(kworker *w) {
    double t = now_s();
    int busy = 0;
    for (int i = 0; i < w->eps_hi; i++) {
        kep *e = w->eps[i];
        if (!e || e->closed) continue;
        if (!e->failed && e->pending > 0 && w->peer_timeout > 0 && t - e->last > w->peer_timeout) {
            e->failed = 1;
            e->status = UCS_ERR_ENDPOINT_TIMEOUT;
        }
        if (!e->failed) {
            if (e->pending > 0) busy = 1;
            continue;
        }
        ucp_request_param_t prm;
        memset(&prm, 0, sizeof(prm));
        prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
        ucs_status_ptr_t r = ucp_ep_close_nbx(e->ep, &prm);
        e->closed = 1;
        if (UCS_PTR_IS_PTR(r)) {
            double until = now_s() + 5.0;
            while (ucp_request_check_status(r) == UCS_INPROGRESS && now_s() < until) ucp_worker_progress(w->worker);
            ucp_request_free(r);
        }
    }
    /* batched AM transfers on a failed or closed endpoint will get no answer */
    for (xfer *x = w->ahead, *nx; x; x = nx) {
        nx = x->anext;
        kep *e = x->ep;
        if (e->failed || e->closed) finish(x, e->status != UCS_OK ? e->status : UCS_ERR_CONNECTION_RESET);
        else busy = 1;
    }
    return busy;
}

/* ---- progress thread --------------------------------------------------------------------- */
/*
 * UCX's wakeup does not signal everything a transport still holds after ucp_worker_arm: a tcp
 * send waiting for the socket to drain is pushed on only by the next progress call. So the
 * thread escalates: within SPIN_S of the last progress made it keeps progressing, yielding the
 * CPU between rounds (a target answering back-to-back small operations stays awake: 40 us per
 * 4 KiB write instead of ~85 us without the spin); within ACTIVE_S (or while a transfer of this
 * worker is pending) it sleeps at most NAP_NS between rounds; idle, it sleeps until the event
 * fd or a post wakes it (no busy core). While a waiter progresses the worker itself
 * (spinners > 0) the thread sleeps on idlecv, so the two do not take turns on the lock and the
 * CPU (2 MiB tcp writes on 2 cores: 4.0-4.4 GB/s when they did, 4.4-5.2 after, alternated runs).
 */
#define ACTIVE_S 0.05
#define SPIN_S 50e-6
#define NAP_NS 200000L

static void *progress_main(void *arg) {
    kworker *w = arg;
    struct epoll_event evs[4];
    double last_active = 0;
    for (;;) {
        pthread_mutex_lock(&w->lk);
        if (w->stop) { pthread_mutex_unlock(&w->lk); break; }
        if (w->spinners > 0) {
            struct timespec ts;
            abs_deadline(&ts, 0.01);
            pthread_cond_timedwait(&w->idlecv, &w->lk, &ts);
            pthread_mutex_unlock(&w->lk);
            last_active = now_s();
            continue;
        }
        unsigned got = 0, k;
        while ((k = ucp_worker_progress(w->worker)) != 0) got += k;
        int busy = reap_failed(w);
        double t = now_s();
        if (got) last_active = t;
        if (t - last_active < SPIN_S) {
            pthread_mutex_unlock(&w->lk);
            sched_yield();
            continue;
        }
        ucs_status_t st = ucp_worker_arm(w->worker);
        pthread_mutex_unlock(&w->lk);
        if (st == UCS_ERR_BUSY) continue;
        if (busy) last_active = last_active > t - ACTIVE_S ? last_active : t - ACTIVE_S / 2;
        int n;
        if (t - last_active < ACTIVE_S) {
            struct timespec ts = {0, NAP_NS};
            n = epoll_pwait2(w->epfd, evs, 4, &ts, NULL);
        } else {
            n = epoll_wait(w->epfd, evs, 4, 1000);
        }
        for (int i = 0; i < n; i++) {
            if (evs[i].data.fd == w->wakefd) {
                uint64_t v;
                ssize_t r = read(w->wakefd, &v, sizeof(v));
                (void)r;
            }
        }
    }
    return NULL;
}

/* ---- active message receive -------------------------------------------------------------- */
static ucs_status_t am_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                          const ucp_am_recv_param_t *param) {
    kworker *w = arg;
    (void)header; (void)hlen;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || len > AM_MAX || w->qlen >= AM_QMAX) {
        w->dropped++;
        return UCS_OK; /* not kept (rendezvous data is never fetched) */
    }
    amsg *m = malloc(sizeof(amsg) + (len ? len : 1));
    if (!m) { w->dropped++; return UCS_OK; }
    m->next = NULL;
    m->len = len;
    if (len) memcpy(m->data, data, len);
    if (w->qtail) w->qtail->next = m; else w->qhead = m;
    w->qtail = m;
    w->qlen++;
    pthread_cond_broadcast(&w->amcv);
    return UCS_OK;
}

/* ---- batched active messages (under lk: handlers run inside ucp_worker_progress) ---------- */
static void am_unlink(xfer *x) {
    kworker *w = x->w;
    if (x->aprev) x->aprev->anext = x->anext; else if (w->ahead == x) w->ahead = x->anext;
    if (x->anext) x->anext->aprev = x->aprev;
    x->anext = x->aprev = NULL;
    x->ep->pending--;
    x->ep->last = now_s();
}

/* the endpoint back to the authenticated peer holding cookie ``c``, or NULL */
static kep *cookie_ep(kworker *w, uint64_t c) {
    if (c == 0) return NULL;
    for (int i = 0; i < MAX_COOKIES; i++) {
        if (w->cookies[i] != c) continue;
        kep *e = w->eps[w->cookie_ep[i]];
        return e && !e->failed && !e->closed ? e : NULL;
    }
    return NULL;
}

static int cmp_ent(const void *a, const void *b) {
    uint64_t x = ((const am_ent *)a)->addr, y = ((const am_ent *)b)->addr;
    return x < y ? -1 : x > y;
}

/*
 * Validate a batch header from a peer against this agent's registrations: the cookie of an
 * authenticated peer, the header's size matching its entry count, every entry inside a live HOST
 * registration of the stated generation, the lengths summing to ``*total`` without overflow and
 * at most AM_BATCH_MAX, and (writes) no two destinations overlapping. 0 or a refusal code.
 */
static int am_check(kworker *w, const void *header, size_t hlen, int write, am_hdr *h, am_ent **ents,
                    uint64_t *total, kep **back) {
    *ents = NULL;
    *back = NULL;
    if (!header || hlen < sizeof(am_hdr)) return 1;
    memcpy(h, header, sizeof(am_hdr));
    if (h->n == 0 || h->n > AM_ENT_MAX || (hlen - sizeof(am_hdr)) % sizeof(am_ent) != 0 ||
        (hlen - sizeof(am_hdr)) / sizeof(am_ent) != h->n) return 2;
    if (!(*back = cookie_ep(w, h->cookie))) return 3;
    am_ent *e = malloc(sizeof(am_ent) * h->n * (write ? 2 : 1)); /* aligned copy (+ one to sort) */
    if (!e) return 9;
    memcpy(e, (const char *)header + sizeof(am_hdr), sizeof(am_ent) * h->n);
    uint64_t sum = 0;
    int bad = 0;
    for (uint32_t i = 0; i < h->n && !bad; i++) {
        const am_ent *q = &e[i];
        const kreg *r = q->slot < NREG ? &w->regs[q->slot] : NULL;
        if (!r) bad = 5;
        else if (!r->live || r->gen != q->gen) bad = 6;
        else if (q->len == 0 || q->addr < r->base || q->len > r->len || q->addr - r->base > r->len - q->len) bad = 7;
        else if (q->len > AM_BATCH_MAX || sum > AM_BATCH_MAX - q->len) bad = 8;
        else sum += q->len;
    }
    if (!bad && write && h->n > 1) {
        am_ent *c = e + h->n;
        memcpy(c, e, sizeof(am_ent) * h->n);
        qsort(c, h->n, sizeof(am_ent), cmp_ent);
        for (uint32_t i = 1; i < h->n && !bad; i++) if (c[i - 1].addr + c[i - 1].len > c[i].addr) bad = 10;
    }
    if (bad) { free(e); return bad; }
    *ents = e;
    *total = sum;
    return 0;
}

static void am_raw_cb(void *req, ucs_status_t st, void *user) {
    (void)st;
    free(user);
    ucp_request_free(req);
}

/* send buf[0:hlen] as the header and buf[hlen:hlen+len] as the payload (eager), then free buf */
static void am_send_buf(ucp_ep_h ep, unsigned id, char *buf, size_t hlen, size_t len) {
    ucp_request_param_t prm;
    memset(&prm, 0, sizeof(prm));
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    prm.cb.send = am_raw_cb;
    prm.user_data = buf;
    prm.op_attr_mask |= UCP_OP_ATTR_FLAG_MULTI_SEND; /* zero-copy up to the transport's segment */
    prm.flags = UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, buf, hlen, buf + hlen, len, &prm);
    if (!UCS_PTR_IS_PTR(r)) free(buf);
}

/* target: a write batch; validate, land every block, acknowledge */
static ucs_status_t wreq_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                            const ucp_am_recv_param_t *param) {
    kworker *w = arg;
    am_hdr h = {0};
    am_ent *e = NULL;
    uint64_t total = 0;
    kep *back;
    int bad = am_check(w, header, hlen, 1, &h, &e, &total, &back);
    if (!bad && (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) bad = 11; /* only eager is sent */
    if (!bad && total != len) bad = 12; /* truncated or padded */
    if (!bad) {
        const char *p = data;
        for (uint32_t i = 0; i < h.n; i++) {
            memcpy((void *)(uintptr_t)e[i].addr, p, e[i].len);
            p += e[i].len;
        }
    } else {
        w->refused++;
    }
    free(e);
    if (back) { /* an unknown cookie gets no answer: nobody to send it to */
        am_ack a = {.xid = h.xid, .batch = h.batch, .status = bad};
        char *buf = malloc(sizeof(a));
        if (buf) { memcpy(buf, &a, sizeof(a)); am_send_buf(back->ep, AM_ACK, buf, sizeof(a), 0); }
    }
    return UCS_OK;
}

/* target: a read batch request; validate, answer with the blocks' bytes (or a refusal) */
static ucs_status_t rreq_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                            const ucp_am_recv_param_t *param) {
    kworker *w = arg;
    (void)data;
    am_hdr h = {0};
    am_ent *e = NULL;
    uint64_t total = 0;
    kep *back;
    int bad = am_check(w, header, hlen, 0, &h, &e, &total, &back);
    if (!bad && len != 0) bad = 12;
    if (!back) { w->refused++; free(e); return UCS_OK; }
    am_ack a = {.xid = h.xid, .batch = h.batch, .status = bad};
    char *buf = malloc(sizeof(am_ack) + (bad ? 0 : total));
    if (!buf) { free(e); return UCS_OK; } /* the initiator's bound fails the transfer */
    if (!bad) {
        char *p = buf + sizeof(am_ack);
        for (uint32_t i = 0; i < h.n; i++) {
            memcpy(p, (const void *)(uintptr_t)e[i].addr, e[i].len);
            p += e[i].len;
        }
    } else {
        w->refused++;
    }
    memcpy(buf, &a, sizeof(a));
    am_send_buf(back->ep, AM_RDATA, buf, sizeof(am_ack), bad ? 0 : total);
    free(e);
    return UCS_OK;
}

static xfer *am_find(kworker *w, uint64_t xid) {
    for (xfer *x = w->ahead; x; x = x->anext) if (x->xid == xid) return x;
    return NULL;
}

/* initiator: a batch's answer (ACK for writes, RDATA for reads) */
static ucs_status_t answer_cb(kworker *w, int rd, const void *header, size_t hlen, const void *data, size_t len,
                              const ucp_am_recv_param_t *param) {
    am_ack a;
    if (hlen != sizeof(am_ack) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) { w->dropped++; return UCS_OK; }
    memcpy(&a, header, sizeof(a));
    xfer *x = am_find(w, a.xid);
    if (!x || x->rd != rd || a.batch >= x->nbatch || x->bdone[a.batch]) { w->dropped++; return UCS_OK; }
    x->ep->last = now_s();
    if (a.status != 0) { finish(x, UCS_ERR_INVALID_ADDR); return UCS_OK; } /* the target refused */
    if (rd) {
        uint32_t b = a.batch;
        if (len != x->bbytes[b]) { finish(x, UCS_ERR_MESSAGE_TRUNCATED); return UCS_OK; }
        for (uint32_t i = x->bstart[b]; i < x->bstart[b + 1]; i++) { /* released since posting? */
            const kreg *r = &w->regs[x->lslot[i]];
            if (!r->live || r->gen != x->lgen[i]) { finish(x, UCS_ERR_CANCELED); return UCS_OK; }
        }
        const char *p = data;
        for (uint32_t i = x->bstart[b]; i < x->bstart[b + 1]; i++) {
            memcpy((void *)(uintptr_t)x->laddr[i], p, x->llen[i]);
            p += x->llen[i];
        }
    } else if (len != 0) {
        finish(x, UCS_ERR_INVALID_ADDR);
        return UCS_OK;
    }
    x->bdone[a.batch] = 1;
    if (--x->left == 0) finish(x, UCS_OK);
    return UCS_OK;
}

static ucs_status_t ack_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param) {
    return answer_cb(arg, 0, header, hlen, data, len, param);
}

static ucs_status_t rdata_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                             const ucp_am_recv_param_t *param) {
    return answer_cb(arg, 1, header, hlen, data, len, param);
}

/* ---- Worker object ----------------------------------------------------------------------- */
static int worker_init(kworker *w, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"options", "peer_timeout", "cuda", NULL};
    PyObject *opts = NULL;
    double pt = 10.0;
    int cuda = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|Odp", kwlist, &opts, &pt, &cuda)) return -1;
    if (w->is_open) { PyErr_SetString(PyExc_RuntimeError, "already initialised"); return -1; }
    w->peer_timeout = pt;
    w->efd = w->wakefd = w->epfd = -1;
    ucp_config_t *cfg = NULL;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) { raise_ucs(st, "ucp_config_read"); return -1; }
    if (opts && opts != Py_None) {
        PyObject *it = PyObject_GetIter(opts);
        if (!it) { ucp_config_release(cfg); return -1; }
        PyObject *item;
        while ((item = PyIter_Next(it))) {
            const char *k, *v;
            if (!PyArg_ParseTuple(item, "ss", &k, &v)) { Py_DECREF(item); Py_DECREF(it); ucp_config_release(cfg); return -1; }
            st = ucp_config_modify(cfg, k, v);
            Py_DECREF(item);
            if (st != UCS_OK) { Py_DECREF(it); ucp_config_release(cfg); raise_ucs(st, k); return -1; }
        }
        Py_DECREF(it);
        if (PyErr_Occurred()) { ucp_config_release(cfg); return -1; }
    }
    ucp_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
    p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    p.name = "kvx";
    (void)cuda;
    Py_BEGIN_ALLOW_THREADS
    st = ucp_init(&p, cfg, &w->ctx);
    Py_END_ALLOW_THREADS
    ucp_config_release(cfg);
    if (st != UCS_OK) { w->ctx = NULL; raise_ucs(st, "ucp_init"); return -1; }
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    Py_BEGIN_ALLOW_THREADS
    st = ucp_worker_create(w->ctx, &wp, &w->worker);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) { w->worker = NULL; raise_ucs(st, "ucp_worker_create"); return -1; }
    st = ucp_worker_get_efd(w->worker, &w->efd);
    if (st != UCS_OK) { raise_ucs(st, "ucp_worker_get_efd"); return -1; }
    ucp_am_handler_param_t hp;
    memset(&hp, 0, sizeof(hp));
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = AM_ID;
    hp.cb = am_cb;
    hp.arg = w;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    st = ucp_worker_set_am_recv_handler(w->worker, &hp);
    if (st != UCS_OK) { raise_ucs(st, "ucp_worker_set_am_recv_handler"); return -1; }
    static const struct { unsigned id; ucp_am_recv_callback_t cb; } hs[] = {
        {AM_WREQ, wreq_cb}, {AM_ACK, ack_cb}, {AM_RREQ, rreq_cb}, {AM_RDATA, rdata_cb}};
    for (size_t i = 0; i < sizeof(hs) / sizeof(hs[0]); i++) {
        hp.id = hs[i].id;
        hp.cb = hs[i].cb;
        st = ucp_worker_set_am_recv_handler(w->worker, &hp);
        if (st != UCS_OK) { raise_ucs(st, "ucp_worker_set_am_recv_handler"); return -1; }
    }
    ucp_worker_attr_t wa;
    memset(&wa, 0, sizeof(wa));
    wa.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
    w->max_hdr = ucp_worker_query(w->worker, &wa) == UCS_OK ? wa.max_am_header : 0;
    w->regs = calloc(NREG, sizeof(kreg));
    if (!w->regs) { PyErr_NoMemory(); return -1; }
    w->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    w->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (w->wakefd < 0 || w->epfd < 0) { PyErr_SetFromErrno(PyExc_OSError); return -1; }
    struct epoll_event ev = {.events = EPOLLIN};
    ev.data.fd = w->efd;
    if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->efd, &ev) < 0) { PyErr_SetFromErrno(PyExc_OSError); return -1; }
    ev.data.fd = w->wakefd;
    if (epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->wakefd, &ev) < 0) { PyErr_SetFromErrno(PyExc_OSError); return -1; }
    pthread_mutex_init(&w->lk, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->cv, &ca);
    pthread_cond_init(&w->amcv, &ca);
    pthread_cond_init(&w->idlecv, &ca);
    pthread_condattr_destroy(&ca);
    w->is_open = 1;
    if (pthread_create(&w->thr, NULL, progress_main, w) != 0) {
        PyErr_SetString(PyExc_OSError, "cannot start the UCX progress thread");
        return -1;
    }
    w->thr_started = 1;
    return 0;
}

static void worker_close_impl(kworker *w) {
    if (w->thr_started) {
        pthread_mutex_lock(&w->lk);
        w->stop = 1;
        pthread_mutex_unlock(&w->lk);
        wake(w);
        pthread_join(w->thr, NULL);
        w->thr_started = 0;
    }
    if (w->worker) {
        pthread_mutex_lock(&w->lk);
        for (int i = 0; i < w->eps_hi; i++) {
            kep *e = w->eps[i];
            if (!e) continue;
            if (!e->closed) {
                ucp_request_param_t prm;
                memset(&prm, 0, sizeof(prm));
                prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
                prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
                ucs_status_ptr_t r = ucp_ep_close_nbx(e->ep, &prm);
                e->closed = 1;
                if (UCS_PTR_IS_PTR(r)) {
                    double until = now_s() + 5.0;
                    while (ucp_request_check_status(r) == UCS_INPROGRESS && now_s() < until)
                        ucp_worker_progress(w->worker);
                    ucp_request_free(r);
                }
            }
        }
        /* batched transfers still waiting for answers: cancelled (the list's references go) */
        while (w->ahead) finish(w->ahead, UCS_ERR_CANCELED);
        w->is_open = 0; /* transfers whose flush never completed read as cancelled */
        pthread_cond_broadcast(&w->cv);
        pthread_cond_broadcast(&w->amcv);
        ucp_worker_destroy(w->worker);
        w->worker = NULL;
        for (int i = 0; i < MAX_EPS; i++) { free(w->eps[i]); w->eps[i] = NULL; }
        pthread_mutex_unlock(&w->lk);
    }
    if (w->ctx) { ucp_cleanup(w->ctx); w->ctx = NULL; }
    if (w->epfd >= 0) { close(w->epfd); w->epfd = -1; }
    if (w->wakefd >= 0) { close(w->wakefd); w->wakefd = -1; }
    while (w->qhead) { amsg *m = w->qhead; w->qhead = m->next; free(m); }
    free(w->regs);
    w->regs = NULL;
    w->qtail = NULL;
    w->qlen = 0;
    if (w->is_open) {
        w->is_open = 0;
    }
}

static PyObject *worker_close(kworker *w, PyObject *unused) {
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    worker_close_impl(w);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void worker_dealloc(kworker *w) {
    worker_close_impl(w);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

#define CHECK_OPEN(w) do { if (!(w)->is_open || !(w)->worker) { PyErr_SetString(PyExc_RuntimeError, "UCX worker is closed"); return NULL; } } while (0)

static PyObject *worker_address(kworker *w, PyObject *unused) {
    (void)unused;
    CHECK_OPEN(w);
    ucp_worker_attr_t a;
    memset(&a, 0, sizeof(a));
    a.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    pthread_mutex_lock(&w->lk);
    ucs_status_t st = ucp_worker_query(w->worker, &a);
    pthread_mutex_unlock(&w->lk);
    if (st != UCS_OK) return raise_ucs(st, "ucp_worker_query");
    PyObject *b = PyBytes_FromStringAndSize((const char *)a.address, (Py_ssize_t)a.address_length);
    ucp_worker_release_address(w->worker, a.address);
    return b;
}

static PyObject *worker_mem_map(kworker *w, PyObject *args) {
    unsigned long long addr, len;
    int cuda;
    if (!PyArg_ParseTuple(args, "KKp", &addr, &len, &cuda)) return NULL;
    CHECK_OPEN(w);
    if (len == 0) { PyErr_SetString(PyExc_ValueError, "empty region"); return NULL; }
    ucp_mem_map_params_t mp;
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    mp.address = (void *)(uintptr_t)addr;
    mp.length = (size_t)len;
    mp.memory_type = cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    ucp_mem_h memh = NULL;
    void *rk = NULL;
    size_t rklen = 0;
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lk);
    st = ucp_mem_map(w->ctx, &mp, &memh);
    if (st == UCS_OK) {
        st = ucp_rkey_pack(w->ctx, memh, &rk, &rklen);
        if (st != UCS_OK) ucp_mem_unmap(w->ctx, memh);
    }
    pthread_mutex_unlock(&w->lk);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) return raise_ucs(st, "ucp_mem_map");
    PyObject *b = PyBytes_FromStringAndSize(rk, (Py_ssize_t)rklen);
    ucp_rkey_buffer_release(rk);
    if (!b) return NULL;
    return Py_BuildValue("(KN)", (unsigned long long)(uintptr_t)memh, b);
}

static PyObject *worker_mem_unmap(kworker *w, PyObject *args) {
    unsigned long long h;
    if (!PyArg_ParseTuple(args, "K", &h)) return NULL;
    CHECK_OPEN(w);
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lk);
    st = ucp_mem_unmap(w->ctx, (ucp_mem_h)(uintptr_t)h);
    pthread_mutex_unlock(&w->lk);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) return raise_ucs(st, "ucp_mem_unmap");
    Py_RETURN_NONE;
}

static kep *get_ep(kworker *w, int id) {
    if (id < 0 || id >= MAX_EPS || !w->eps[id]) {
        PyErr_Format(PyExc_ValueError, "unknown endpoint %d", id);
        return NULL;
    }
    return w->eps[id];
}

static PyObject *worker_ep_create(kworker *w, PyObject *args) {
    Py_buffer a;
    int peer_errors = 1;
    if (!PyArg_ParseTuple(args, "y*|p", &a, &peer_errors)) return NULL;
    if (!w->is_open || !w->worker) { PyBuffer_Release(&a); PyErr_SetString(PyExc_RuntimeError, "UCX worker is closed"); return NULL; }
    if (a.len < 8 || a.len > (1 << 16)) {
        PyBuffer_Release(&a);
        PyErr_SetString(PyExc_ValueError, "malformed UCX worker address");
        return NULL;
    }
    kep *e = calloc(1, sizeof(kep));
    if (!e) { PyBuffer_Release(&a); return PyErr_NoMemory(); }
    int id = -1;
    ucs_status_t st = UCS_ERR_EXCEEDS_LIMIT;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lk);
    for (int i = 0; i < MAX_EPS; i++) if (!w->eps[i]) { id = i; break; }
    if (id >= 0) {
        ucp_ep_params_t ep;
        memset(&ep, 0, sizeof(ep));
        ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.address = (const ucp_address_t *)a.buf;
        ep.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
        ep.err_handler.cb = ep_err_cb;
        ep.err_handler.arg = e;
        /* a first try with peer failure handling may be refused by the transports in use (UCX's
           shared-memory transports): keep UCX from logging that expected refusal as an error */
        char lvl[64] = "";
        int quiet = peer_errors && ucs_global_opts_get_value("LOG_LEVEL", lvl, sizeof(lvl)) == UCS_OK &&
                    ucs_global_opts_set_value("LOG_LEVEL", "fatal") == UCS_OK;
        st = ucp_ep_create(w->worker, &ep, &e->ep);
        if (quiet) ucs_global_opts_set_value("LOG_LEVEL", lvl);
        if (st == UCS_OK) {
            e->peer_errors = peer_errors;
            e->id = id;
            e->last = now_s();
            w->eps[id] = e;
            if (id >= w->eps_hi) w->eps_hi = id + 1;
        }
    }
    pthread_mutex_unlock(&w->lk);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&a);
    if (st != UCS_OK) { free(e); return raise_ucs(st, "ucp_ep_create"); }
    wake(w);
    return PyLong_FromLong(id);
}

/* Close an endpoint (graceful flush within ``timeout``, then forced) and forget it. */
static PyObject *worker_ep_close(kworker *w, PyObject *args) {
    int id, force = 0;
    double timeout = 2.0;
    if (!PyArg_ParseTuple(args, "i|dp", &id, &timeout, &force)) return NULL;
    CHECK_OPEN(w);
    pthread_mutex_lock(&w->lk);
    kep *e = get_ep(w, id);
    pthread_mutex_unlock(&w->lk);
    if (!e) return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lk);
    if (!e->closed) {
        ucp_request_param_t prm;
        memset(&prm, 0, sizeof(prm));
        prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        prm.flags = (e->failed || force) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
        if (!e->failed) { e->failed = 1; e->status = UCS_ERR_CANCELED; }
        ucs_status_ptr_t r = ucp_ep_close_nbx(e->ep, &prm);
        e->closed = 1;
        if (UCS_PTR_IS_PTR(r)) {
            double until = now_s() + timeout;
            while (ucp_request_check_status(r) == UCS_INPROGRESS && now_s() < until) {
                if (ucp_worker_progress(w->worker) == 0) {
                    pthread_mutex_unlock(&w->lk);
                    usleep(100);
                    pthread_mutex_lock(&w->lk);
                }
            }
            if (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_request_cancel(w->worker, r);
            ucp_request_free(r);
        }
    }
    if (e->pending == 0) {
        w->eps[id] = NULL;
        free(e);
    } /* else: pending flushes still reference it; it stays (closed) until the worker goes */
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->lk);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *worker_ep_status(kworker *w, PyObject *args) {
    int id;
    if (!PyArg_ParseTuple(args, "i", &id)) return NULL;
    CHECK_OPEN(w);
    pthread_mutex_lock(&w->lk);
    kep *e = get_ep(w, id);
    int st = e ? (e->failed ? (int)(e->status != UCS_OK ? e->status : UCS_ERR_CANCELED) : 0) : 0;
    pthread_mutex_unlock(&w->lk);
    if (!e) return NULL;
    return PyLong_FromLong(st);
}

static PyObject *worker_ep_peer_errors(kworker *w, PyObject *args) {
    int id;
    if (!PyArg_ParseTuple(args, "i", &id)) return NULL;
    CHECK_OPEN(w);
    pthread_mutex_lock(&w->lk);
    kep *e = get_ep(w, id);
    int pe = e ? e->peer_errors : 0;
    pthread_mutex_unlock(&w->lk);
    if (!e) return NULL;
    return PyBool_FromLong(pe);
}

static PyObject *worker_rkey_unpack(kworker *w, PyObject *args) {
    int id;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "iy*", &id, &b)) return NULL;
    if (!w->is_open || !w->worker) { PyBuffer_Release(&b); PyErr_SetString(PyExc_RuntimeError, "UCX worker is closed"); return NULL; }
    if (b.len < 1 || b.len > (1 << 16)) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "malformed UCX remote key");
        return NULL;
    }
    ucp_rkey_h rk = NULL;
    ucs_status_t st;
    pthread_mutex_lock(&w->lk);
    kep *e = get_ep(w, id);
    if (!e) { pthread_mutex_unlock(&w->lk); PyBuffer_Release(&b); return NULL; }
    st = e->closed ? UCS_ERR_CONNECTION_RESET : ucp_ep_rkey_unpack(e->ep, b.buf, &rk);
    pthread_mutex_unlock(&w->lk);
    PyBuffer_Release(&b);
    if (st != UCS_OK) return raise_ucs(st, "ucp_ep_rkey_unpack");
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)rk);
}

static PyObject *worker_rkey_destroy(kworker *w, PyObject *args) {
    unsigned long long h;
    if (!PyArg_ParseTuple(args, "K", &h)) return NULL;
    CHECK_OPEN(w);
    pthread_mutex_lock(&w->lk);
    ucp_rkey_destroy((ucp_rkey_h)(uintptr_t)h);
    pthread_mutex_unlock(&w->lk);
    Py_RETURN_NONE;
}

/* a 1-D buffer of 8-byte integers */
static int u64buf(PyObject *o, Py_buffer *b, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (b->itemsize != 8 || b->ndim != 1 || !b->format || !strchr("qQlLN", b->format[b->format[0] == '<' || b->format[0] == '=' ? 1 : 0])) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D array of 8-byte integers", what);
        return -1;
    }
    return 0;
}

static PyObject *xfer_new(kworker *w, xfer *x);
static void issue_flush(kworker *w, kep *e, xfer *x, ucs_status_t st);

/* endpoint ``id`` for a new post (under lk): UCS_OK, or why none can go out on it */
static ucs_status_t ep_for_post(kworker *w, int id, kep **out) {
    kep *e = (id >= 0 && id < MAX_EPS) ? w->eps[id] : NULL;
    *out = e;
    if (!e) return UCS_ERR_INVALID_PARAM;
    if (e->failed || e->closed) return e->status != UCS_OK ? e->status : UCS_ERR_CONNECTION_RESET;
    return UCS_OK;
}

/* a new transfer of ``total`` bytes (one reference: the caller's) carrying a copy of the
   notification ``notif`` (bytes, at most AM_MAX, or None); NULL with a Python error set */
static xfer *xfer_make(kworker *w, uint64_t total, PyObject *notif) {
    char *p = NULL;
    Py_ssize_t nlen = 0;
    if (notif != Py_None) {
        if (PyBytes_AsStringAndSize(notif, &p, &nlen) < 0) return NULL;
        if (nlen > AM_MAX) { PyErr_SetString(PyExc_ValueError, "notification too large"); return NULL; }
    }
    xfer *x = calloc(1, sizeof(xfer));
    char *copy = notif != Py_None ? malloc(nlen ? nlen : 1) : NULL;
    if (!x || (notif != Py_None && !copy)) { free(x); free(copy); PyErr_NoMemory(); return NULL; }
    if (copy) memcpy(copy, p, nlen);
    x->w = w;
    x->refs = 1;
    x->nbytes = total;
    x->notif = copy;
    x->notif_len = (size_t)nlen;
    return x;
}

/*
 * post(op, ep, lidx, laddr, lnb, lmemh, ridx, raddr, rnb, rkey, notif=None) -> Xfer
 *   op: 0 write (put), 1 read (get). lidx/ridx: int64 indices into the (full) prepared arrays;
 *   every index is bounds-checked and paired lengths must match (ValueError/IndexError).
 */
static PyObject *worker_post(kworker *w, PyObject *args) {
    int op, id;
    PyObject *o[8];
    PyObject *notif = Py_None;
    if (!PyArg_ParseTuple(args, "iiOOOOOOOO|O", &op, &id, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7],
                          &notif))
        return NULL;
    CHECK_OPEN(w);
    static const char *names[8] = {"lidx", "laddr", "lnbytes", "lmemh", "ridx", "raddr", "rnbytes", "rkey"};
    Py_buffer b[8];
    int got = 0;
    PyObject *res = NULL;
    for (; got < 8; got++)
        if (u64buf(o[got], &b[got], names[got]) < 0) goto out;
    Py_ssize_t n = b[0].len / 8, nl = b[1].len / 8, nr = b[5].len / 8;
    if (b[4].len / 8 != n) { PyErr_SetString(PyExc_ValueError, "local and remote index lists differ in length"); goto out; }
    if (b[2].len / 8 != nl || b[3].len / 8 != nl || b[6].len / 8 != nr || b[7].len / 8 != nr) {
        PyErr_SetString(PyExc_ValueError, "descriptor arrays differ in length");
        goto out;
    }
    const int64_t *li = b[0].buf, *ri = b[4].buf;
    const uint64_t *la = b[1].buf, *ln = b[2].buf, *lm = b[3].buf, *ra = b[5].buf, *rn = b[6].buf, *rk = b[7].buf;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t a = li[i], c = ri[i];
        if (a < 0 || a >= nl || c < 0 || c >= nr) { PyErr_Format(PyExc_IndexError, "index out of range at position %zd", i); goto out; }
        if (ln[a] != rn[c]) { PyErr_Format(PyExc_ValueError, "descriptor lengths differ at position %zd", i); goto out; }
        total += ln[a];
    }
    xfer *x = xfer_make(w, total, notif);
    if (!x) goto out;
    ucs_status_t st = UCS_OK;
    int finished = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lk);
    kep *e;
    st = ep_for_post(w, id, &e);
    if (st == UCS_OK) {
        x->ep = e;
        ucp_request_param_t prm;
        memset(&prm, 0, sizeof(prm));
        /* MULTI_SEND: UCX picks its protocols for the bandwidth of many operations in flight */
        prm.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                           UCP_OP_ATTR_FLAG_MULTI_SEND;
        prm.cb.send = op_cb;
        prm.user_data = e;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t a = li[i], c = ri[i];
            if (ln[a] == 0) continue;
            prm.memh = (ucp_mem_h)(uintptr_t)lm[a];
            ucs_status_ptr_t r = op == 0
                ? ucp_put_nbx(e->ep, (void *)(uintptr_t)la[a], ln[a], ra[c], (ucp_rkey_h)(uintptr_t)rk[c], &prm)
                : ucp_get_nbx(e->ep, (void *)(uintptr_t)la[a], ln[a], ra[c], (ucp_rkey_h)(uintptr_t)rk[c], &prm);
            if (r == NULL) continue;
            if (UCS_PTR_IS_ERR(r)) { st = UCS_PTR_STATUS(r); break; }
            (void)r; /* op_cb frees it; the flush covers its completion */
        }
        issue_flush(w, e, x, st); /* done when every operation above completed at the target */
    } else {
        x->done = 1;
        x->status = st;
    }
    /* completed while posting (a kernel copy) and no notification left to push: no thread hop */
    finished = x->done && !x->notif;
    pthread_mutex_unlock(&w->lk);
    Py_END_ALLOW_THREADS
    if (!finished) wake(w);
    res = xfer_new(w, x);
    if (!res) {
        pthread_mutex_lock(&w->lk);
        xfer_unref(x);
        pthread_mutex_unlock(&w->lk);
    }
out:
    for (int i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    return res;
}

/* issue the flush that completes ``x`` (under lk; ``st``: an error already seen while posting) */
static void issue_flush(kworker *w, kep *e, xfer *x, ucs_status_t st) {
    x->ep = e;
    ucp_request_param_t fp;
    memset(&fp, 0, sizeof(fp));
    fp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    fp.cb.send = flush_cb;
    fp.user_data = x;
    ucs_status_ptr_t r = ucp_ep_flush_nbx(e->ep, &fp);
    if (r == NULL) {
        finish(x, st);
    } else if (UCS_PTR_IS_ERR(r)) {
        finish(x, st != UCS_OK ? st : UCS_PTR_STATUS(r));
    } else {
        x->refs++;
        if (e->pending == 0) e->last = now_s();
        e->pending++;
        if (st != UCS_OK) { e->failed = 1; e->status = st; }
    }
    ucp_worker_progress(w->worker);
}

/* flush(ep) -> Xfer: done when every operation posted on the endpoint before it completed */
static PyObject *worker_flush(kworker *w, PyObject *args) {
    int id;
    if (!PyArg_ParseTuple(args, "i", &id)) return NULL;
    CHECK_OPEN(w);
    xfer *x = calloc(1, sizeof(xfer));
    if (!x) return PyErr_NoMemory();
    x->w = w;
    x->refs = 1;
    int finished = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lk);
    kep *e = (id >= 0 && id < MAX_EPS) ? w->eps[id] : NULL;
    if (!e || e->failed || e->closed) {
        x->done = 1;
        x->status = e && e->status != UCS_OK ? e->status : UCS_ERR_CONNECTION_RESET;
    } else {
        issue_flush(w, e, x, UCS_OK);
    }
    finished = x->done;
    pthread_mutex_unlock(&w->lk);
    Py_END_ALLOW_THREADS
    if (!finished) wake(w);
    PyObject *res = xfer_new(w, x);
    if (!res) {
        pthread_mutex_lock(&w->lk);
        xfer_unref(x);
        pthread_mutex_unlock(&w->lk);
    }
    return res;
}

/* ---- batched active-message transfers: posting ------------------------------------------- */
typedef struct {
    xfer *x;
    size_t hlen;
    uint32_t n;
    char *hdr;          /* am_hdr + entries */
    ucp_dt_iov_t iov[]; /* write: the source blocks */
} am_batch;

static void batch_cb(void *req, ucs_status_t st, void *user) {
    am_batch *b = user;
    if (st != UCS_OK) finish(b->x, st);
    xfer_unref(b->x);
    free(b);
    ucp_request_free(req);
}

/*
 * post_am(op, ep, lidx, laddr, lnbytes, lslot, ridx, raddr, rnbytes, rslot, rgen, cookie, batch_bytes, notif=None)
 *   -> Xfer. A transfer of HOST memory as batched active messages: each batch lists up to
 *   ``batch_bytes`` of blocks (and at most what fits one AM header); a write batch carries the
 *   source blocks as its payload (an IOV, no gather), a read batch asks the target for them. The
 *   target validates every entry against its registrations and answers each batch; the transfer
 *   completes when every batch is answered (writes: landed), then its notification is sent.
 */
static PyObject *worker_post_am(kworker *w, PyObject *args) {
    int op, id;
    PyObject *o[10];
    unsigned long long cookie, bb;
    PyObject *notif = Py_None;
    if (!PyArg_ParseTuple(args, "iiOOOOOOOOOOKK|O", &op, &id, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6],
                          &o[7], &o[8], &o[9], &cookie, &bb, &notif))
        return NULL;
    CHECK_OPEN(w);
    static const char *names[10] = {"lidx", "laddr", "lnbytes", "lslot", "ridx", "raddr", "rnbytes", "rslot",
                                    "rgen", "unused"};
    Py_buffer b[9];
    int got = 0;
    PyObject *res = NULL;
    xfer *x = NULL;
    for (; got < 9; got++)
        if (u64buf(o[got], &b[got], names[got]) < 0) goto out;
    if (o[9] != Py_None) { PyErr_SetString(PyExc_TypeError, "reserved argument must be None"); goto out; }
    Py_ssize_t n = b[0].len / 8, nl = b[1].len / 8, nr = b[5].len / 8;
    if (b[4].len / 8 != n) { PyErr_SetString(PyExc_ValueError, "local and remote index lists differ in length"); goto out; }
    if (b[2].len / 8 != nl || b[3].len / 8 != nl || b[6].len / 8 != nr || b[7].len / 8 != nr || b[8].len / 8 != nr) {
        PyErr_SetString(PyExc_ValueError, "descriptor arrays differ in length");
        goto out;
    }
    if (bb == 0) bb = 1;
    const int64_t *li = b[0].buf, *ri = b[4].buf;
    const uint64_t *la = b[1].buf, *ln = b[2].buf, *ls = b[3].buf, *ra = b[5].buf, *rn = b[6].buf, *rs = b[7].buf,
                   *rg = b[8].buf;
    uint64_t total = 0;
    Py_ssize_t m = 0; /* non-empty pairs */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t a = li[i], c = ri[i];
        if (a < 0 || a >= nl || c < 0 || c >= nr) { PyErr_Format(PyExc_IndexError, "index out of range at position %zd", i); goto out; }
        if (ln[a] != rn[c]) { PyErr_Format(PyExc_ValueError, "descriptor lengths differ at position %zd", i); goto out; }
        if (ls[a] >= NREG || rs[c] >= NREG) { PyErr_Format(PyExc_ValueError, "bad region slot at position %zd", i); goto out; }
        if (ln[a] > AM_BATCH_MAX) { PyErr_Format(PyExc_ValueError, "block too large for batched messages at position %zd", i); goto out; }
        total += ln[a];
        if (ln[a]) m++;
    }
    if (m > 0xffffffffLL) { PyErr_SetString(PyExc_ValueError, "too many blocks"); goto out; }
    size_t per = w->max_hdr > sizeof(am_hdr) ? (w->max_hdr - sizeof(am_hdr)) / sizeof(am_ent) : 0;
    if (per > AM_ENT_MAX) per = AM_ENT_MAX;
    if (per == 0) { PyErr_SetString(PyExc_ValueError, "UCX active message headers too small for batches"); goto out; }
    x = xfer_make(w, total, notif);
    if (!x) goto out;
    x->rd = op == 1;
    /* batch boundaries: at most ``per`` entries and (unless one block) ``bb`` bytes each */
    x->bstart = malloc(sizeof(uint32_t) * (m + 2));
    x->bbytes = malloc(sizeof(uint64_t) * (m + 1));
    if (!x->bstart || !x->bbytes) { PyErr_NoMemory(); goto out; }
    uint32_t nb = 0, cnt = 0;
    uint64_t bytes = 0;
    x->bstart[0] = 0;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t len = ln[li[i]];
        if (!len) continue;
        if (cnt > 0 && (cnt >= per || bytes + len > bb)) {
            x->bbytes[nb] = bytes;
            x->bstart[++nb] = (uint32_t)k;
            cnt = 0; bytes = 0;
        }
        cnt++; bytes += len; k++;
    }
    if (cnt) { x->bbytes[nb] = bytes; x->bstart[++nb] = (uint32_t)k; }
    x->nbatch = x->left = nb;
    x->bdone = calloc(nb ? nb : 1, 1);
    if (!x->bdone) { PyErr_NoMemory(); goto out; }
    if (x->rd) {
        x->laddr = malloc(sizeof(uint64_t) * (m ? m : 1));
        x->llen = malloc(sizeof(uint64_t) * (m ? m : 1));
        x->lslot = malloc(sizeof(uint32_t) * (m ? m : 1));
        x->lgen = malloc(sizeof(uint32_t) * (m ? m : 1));
        if (!x->laddr || !x->llen || !x->lslot || !x->lgen) { PyErr_NoMemory(); goto out; }
    }
    ucs_status_t st = UCS_OK;
    int stale = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lk);
    kep *e;
    st = ep_for_post(w, id, &e);
    /* the local blocks lie in live HOST registrations (of this worker's table) */
    for (Py_ssize_t i = 0, j = 0; st == UCS_OK && i < n; i++) {
        int64_t a = li[i];
        if (!ln[a]) continue;
        const kreg *r = &w->regs[ls[a]];
        if (!r->live || la[a] < r->base || ln[a] > r->len || la[a] - r->base > r->len - ln[a]) { stale = 1; st = UCS_ERR_INVALID_PARAM; break; }
        if (x->rd) { x->laddr[j] = la[a]; x->llen[j] = ln[a]; x->lslot[j] = (uint32_t)ls[a]; x->lgen[j] = r->gen; }
        j++;
    }
    if (st == UCS_OK) {
        x->ep = e;
        if (nb == 0) {
            finish(x, UCS_OK); /* nothing to move: the notification alone */
        } else {
            x->am = 1;
            x->xid = ++w->next_xid ^ ((uint64_t)(uintptr_t)x << 20);
            while (am_find(w, x->xid)) x->xid++;
            x->anext = w->ahead;
            if (w->ahead) w->ahead->aprev = x;
            w->ahead = x;
            x->refs++; /* the in-flight list's */
            if (e->pending == 0) e->last = now_s();
            e->pending++;
            Py_ssize_t i = 0;
            for (uint32_t bi = 0; bi < nb && !x->done; bi++) {
                uint32_t cn = x->bstart[bi + 1] - x->bstart[bi];
                size_t hlen = sizeof(am_hdr) + sizeof(am_ent) * cn;
                am_batch *bt = malloc(sizeof(am_batch) + (x->rd ? 0 : sizeof(ucp_dt_iov_t) * cn) + hlen);
                if (!bt) { finish(x, UCS_ERR_NO_MEMORY); break; }
                bt->x = x;
                bt->n = cn;
                bt->hlen = hlen;
                bt->hdr = (char *)bt + sizeof(am_batch) + (x->rd ? 0 : sizeof(ucp_dt_iov_t) * cn);
                am_hdr h = {.cookie = cookie, .xid = x->xid, .batch = bi, .n = cn};
                memcpy(bt->hdr, &h, sizeof(h));
                am_ent *ents = (am_ent *)(bt->hdr + sizeof(am_hdr));
                for (uint32_t c = 0; c < cn; i++) {
                    int64_t a = li[i], r = ri[i];
                    if (!ln[a]) continue;
                    am_ent en = {.addr = ra[r], .len = rn[r], .slot = (uint32_t)rs[r], .gen = (uint32_t)rg[r]};
                    memcpy(&ents[c], &en, sizeof(en));
                    if (!x->rd) { bt->iov[c].buffer = (void *)(uintptr_t)la[a]; bt->iov[c].length = ln[a]; }
                    c++;
                }
                ucp_request_param_t prm;
                memset(&prm, 0, sizeof(prm));
                prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
                prm.cb.send = batch_cb;
                prm.user_data = bt;
                prm.op_attr_mask |= UCP_OP_ATTR_FLAG_MULTI_SEND;
                prm.flags = UCP_AM_SEND_FLAG_EAGER;
                ucs_status_ptr_t r;
                if (x->rd) {
                    r = ucp_am_send_nbx(e->ep, AM_RREQ, bt->hdr, hlen, NULL, 0, &prm);
                } else {
                    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
                    prm.datatype = ucp_dt_make_iov();
                    r = ucp_am_send_nbx(e->ep, AM_WREQ, bt->hdr, hlen, bt->iov, cn, &prm);
                }
                w->batches++;
                if (UCS_PTR_IS_PTR(r)) { x->refs++; continue; }
                free(bt);
                if (UCS_PTR_IS_ERR(r)) { finish(x, UCS_PTR_STATUS(r)); break; }
            }
            ucp_worker_progress(w->worker);
        }
    } else {
        x->done = 1;
        x->status = st;
    }
    pthread_mutex_unlock(&w->lk);
    Py_END_ALLOW_THREADS
    if (stale) {
        PyErr_SetString(PyExc_ValueError, "a local block is not in a live host registration");
        goto out;
    }
    wake(w);
    res = xfer_new(w, x);
    if (res) x = NULL;
out:
    if (x) {
        pthread_mutex_lock(&w->lk);
        xfer_unref(x);
        pthread_mutex_unlock(&w->lk);
    }
    for (int i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    return res;
}

/* region_add(slot, gen, addr, nbytes) / region_del(slot): the HOST registrations batches may reach */
static PyObject *worker_region_add(kworker *w, PyObject *args) {
    unsigned int slot, gen;
    unsigned long long addr, len;
    if (!PyArg_ParseTuple(args, "IIKK", &slot, &gen, &addr, &len)) return NULL;
    CHECK_OPEN(w);
    if (slot >= NREG || len == 0 || addr + len < addr) { PyErr_SetString(PyExc_ValueError, "bad region"); return NULL; }
    pthread_mutex_lock(&w->lk);
    w->regs[slot] = (kreg){.base = addr, .len = len, .gen = gen, .live = 1};
    pthread_mutex_unlock(&w->lk);
    Py_RETURN_NONE;
}

static PyObject *worker_region_del(kworker *w, PyObject *args) {
    unsigned int slot;
    if (!PyArg_ParseTuple(args, "I", &slot)) return NULL;
    CHECK_OPEN(w);
    if (slot >= NREG) { PyErr_SetString(PyExc_ValueError, "bad region slot"); return NULL; }
    pthread_mutex_lock(&w->lk); /* handlers land data under this lock: none lands here after this */
    w->regs[slot].live = 0;
    pthread_mutex_unlock(&w->lk);
    Py_RETURN_NONE;
}

/* cookie_add(c) / cookie_del(c): the batch cookies of authenticated peers */
static PyObject *worker_cookie(kworker *w, PyObject *args, int add) {
    unsigned long long c;
    int ep = -1;
    if (!PyArg_ParseTuple(args, add ? "Ki" : "K", &c, &ep)) return NULL;
    CHECK_OPEN(w);
    if (c == 0) { PyErr_SetString(PyExc_ValueError, "cookie 0 is reserved"); return NULL; }
    if (add && (ep < 0 || ep >= MAX_EPS)) { PyErr_SetString(PyExc_ValueError, "bad endpoint"); return NULL; }
    int ok = !add;
    pthread_mutex_lock(&w->lk);
    for (int i = 0; i < MAX_COOKIES; i++) {
        if (add && w->cookies[i] == 0) { w->cookies[i] = c; w->cookie_ep[i] = ep; ok = 1; break; }
        if (!add && w->cookies[i] == c) w->cookies[i] = 0;
    }
    pthread_mutex_unlock(&w->lk);
    if (!ok) { PyErr_SetString(PyExc_ValueError, "too many peers"); return NULL; }
    Py_RETURN_NONE;
}

static PyObject *worker_cookie_add(kworker *w, PyObject *args) { return worker_cookie(w, args, 1); }
static PyObject *worker_cookie_del(kworker *w, PyObject *args) { return worker_cookie(w, args, 0); }

/* ep_rma(id) -> True when a lane of the endpoint is a transport with real one-sided RMA
   (RDMA, cuda_ipc, gdr_copy, cma/knem/xpmem); False for tcp and shared-memory FIFOs alone */
static PyObject *worker_ep_transports(kworker *w, PyObject *args) {
    int id;
    if (!PyArg_ParseTuple(args, "i", &id)) return NULL;
    CHECK_OPEN(w);
    ucp_transport_entry_t ents[32];
    ucp_ep_attr_t a;
    memset(&a, 0, sizeof(a));
    a.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    a.transports.entries = ents;
    a.transports.num_entries = 32;
    a.transports.entry_size = sizeof(ucp_transport_entry_t);
    pthread_mutex_lock(&w->lk);
    kep *e = get_ep(w, id);
    ucs_status_t st = e ? (e->closed ? UCS_ERR_CONNECTION_RESET : ucp_ep_query(e->ep, &a)) : UCS_OK;
    PyObject *out = NULL;
    if (e && st == UCS_OK) {
        out = PyList_New(0);
        for (unsigned i = 0; out && i < a.transports.num_entries; i++) {
            PyObject *t = Py_BuildValue("(ss)", ents[i].transport_name ? ents[i].transport_name : "",
                                        ents[i].device_name ? ents[i].device_name : "");
            if (!t || PyList_Append(out, t) < 0) Py_CLEAR(out);
            Py_XDECREF(t);
        }
    }
    pthread_mutex_unlock(&w->lk);
    if (!e) return NULL;
    if (st != UCS_OK) return raise_ucs(st, "ucp_ep_query");
    return out;
}

/* am_send_raw(ep, id, header, payload): any batched-message id with any bytes (tests play a
   hostile peer with it) */
static PyObject *worker_am_send_raw(kworker *w, PyObject *args) {
    int id;
    unsigned int amid;
    Py_buffer h, d;
    if (!PyArg_ParseTuple(args, "iIy*y*", &id, &amid, &h, &d)) return NULL;
    PyObject *res = NULL;
    if (!w->is_open || !w->worker) { PyErr_SetString(PyExc_RuntimeError, "UCX worker is closed"); goto out; }
    if (amid < AM_WREQ || amid > AM_RDATA) { PyErr_SetString(PyExc_ValueError, "not a batched-message id"); goto out; }
    if (h.len > (1 << 20) || d.len > AM_BATCH_MAX) { PyErr_SetString(PyExc_ValueError, "too large"); goto out; }
    char *buf = malloc((size_t)(h.len + d.len) + 1);
    if (!buf) { PyErr_NoMemory(); goto out; }
    memcpy(buf, h.buf, h.len);
    memcpy(buf + h.len, d.buf, d.len);
    int bad = 0;
    pthread_mutex_lock(&w->lk);
    kep *e = (id >= 0 && id < MAX_EPS) ? w->eps[id] : NULL;
    if (!e || e->failed || e->closed) { bad = 1; free(buf); }
    else { am_send_buf(e->ep, amid, buf, (size_t)h.len, (size_t)d.len); ucp_worker_progress(w->worker); }
    pthread_mutex_unlock(&w->lk);
    wake(w);
    if (bad) { PyErr_Format(PyExc_ValueError, "unknown or failed endpoint %d", id); goto out; }
    res = Py_None;
    Py_INCREF(res);
out:
    PyBuffer_Release(&h);
    PyBuffer_Release(&d);
    return res;
}

static PyObject *worker_am_send(kworker *w, PyObject *args) {
    int id;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "iy*", &id, &b)) return NULL;
    if (!w->is_open || !w->worker) { PyBuffer_Release(&b); PyErr_SetString(PyExc_RuntimeError, "UCX worker is closed"); return NULL; }
    if (b.len > AM_MAX) { PyBuffer_Release(&b); PyErr_SetString(PyExc_ValueError, "message too large"); return NULL; }
    ucs_status_t st;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lk);
    kep *e = (id >= 0 && id < MAX_EPS) ? w->eps[id] : NULL;
    if (!e) { bad = 1; st = UCS_ERR_INVALID_PARAM; }
    else st = am_send_locked(w, e, b.buf, (size_t)b.len);
    if (st == UCS_OK) ucp_worker_progress(w->worker);
    pthread_mutex_unlock(&w->lk);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    wake(w);
    if (bad) { PyErr_Format(PyExc_ValueError, "unknown endpoint %d", id); return NULL; }
    if (st != UCS_OK) return raise_ucs(st, "ucp_am_send_nbx");
    Py_RETURN_NONE;
}

/* am_recv(timeout) -> list[bytes]: queued messages (waits up to timeout for the first) */
static PyObject *worker_am_recv(kworker *w, PyObject *args) {
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout)) return NULL;
    CHECK_OPEN(w);
    amsg *head = NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lk);
    if (!w->qhead && timeout > 0 && !w->stop) {
        struct timespec ts;
        abs_deadline(&ts, timeout);
        while (!w->qhead && !w->stop) {
            if (pthread_cond_timedwait(&w->amcv, &w->lk, &ts) == ETIMEDOUT) break;
        }
    }
    head = w->qhead;
    w->qhead = w->qtail = NULL;
    w->qlen = 0;
    pthread_mutex_unlock(&w->lk);
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(0);
    while (head) {
        amsg *m = head;
        head = m->next;
        if (out) {
            PyObject *b = PyBytes_FromStringAndSize(m->data, (Py_ssize_t)m->len);
            if (!b || PyList_Append(out, b) < 0) { Py_CLEAR(out); }
            Py_XDECREF(b);
        }
        free(m);
    }
    return out;
}

/* wake a thread blocked in am_recv (for shutdown) */
static PyObject *worker_interrupt(kworker *w, PyObject *unused) {
    (void)unused;
    if (!w->is_open) Py_RETURN_NONE;
    pthread_mutex_lock(&w->lk);
    pthread_cond_broadcast(&w->amcv);
    pthread_mutex_unlock(&w->lk);
    Py_RETURN_NONE;
}

static PyObject *worker_stats(kworker *w, PyObject *unused) {
    (void)unused;
    long neps = 0, pend = 0;
    pthread_mutex_lock(&w->lk);
    for (int i = 0; i < w->eps_hi; i++) if (w->eps[i]) { neps++; pend += w->eps[i]->pending; }
    long dropped = w->dropped, refused = w->refused, batches = w->batches, inflight = 0;
    for (xfer *x = w->ahead; x; x = x->anext) inflight++;
    pthread_mutex_unlock(&w->lk);
    return Py_BuildValue("{s:l,s:l,s:l,s:l,s:l,s:l,s:n}", "endpoints", neps, "pending", pend, "dropped", dropped,
                         "refused", refused, "batches", batches, "am_inflight", inflight,
                         "max_am_header", (Py_ssize_t)w->max_hdr);
}

static PyMethodDef worker_methods[] = {
    {"close", (PyCFunction)worker_close, METH_NOARGS, "Stop the progress thread, close endpoints, destroy the worker."},
    {"address", (PyCFunction)worker_address, METH_NOARGS, "This worker's UCP address (bytes)."},
    {"mem_map", (PyCFunction)worker_mem_map, METH_VARARGS, "mem_map(addr, nbytes, cuda) -> (memh, packed rkey)."},
    {"mem_unmap", (PyCFunction)worker_mem_unmap, METH_VARARGS, "mem_unmap(memh)."},
    {"ep_create", (PyCFunction)worker_ep_create, METH_VARARGS, "ep_create(worker address, peer_errors=True) -> endpoint id (UCP_ERR_HANDLING_MODE_PEER, or NONE)."},
    {"ep_close", (PyCFunction)worker_ep_close, METH_VARARGS, "ep_close(id, timeout=2.0, force=False): graceful (bounded) or forced; pending transfers fail."},
    {"ep_status", (PyCFunction)worker_ep_status, METH_VARARGS, "ep_status(id) -> 0 or the UCS error that failed it."},
    {"ep_peer_errors", (PyCFunction)worker_ep_peer_errors, METH_VARARGS, "ep_peer_errors(id) -> whether it has peer failure handling."},
    {"rkey_unpack", (PyCFunction)worker_rkey_unpack, METH_VARARGS, "rkey_unpack(ep id, packed) -> rkey handle."},
    {"rkey_destroy", (PyCFunction)worker_rkey_destroy, METH_VARARGS, "rkey_destroy(handle)."},
    {"post", (PyCFunction)worker_post, METH_VARARGS, "Post a transfer (see the module docstring)."},
    {"post_am", (PyCFunction)worker_post_am, METH_VARARGS, "Post a transfer as batched active messages (HOST memory)."},
    {"region_add", (PyCFunction)worker_region_add, METH_VARARGS, "region_add(slot, gen, addr, nbytes)."},
    {"region_del", (PyCFunction)worker_region_del, METH_VARARGS, "region_del(slot)."},
    {"cookie_add", (PyCFunction)worker_cookie_add, METH_VARARGS, "cookie_add(c, ep): the peer reached by ep may send batches with c."},
    {"cookie_del", (PyCFunction)worker_cookie_del, METH_VARARGS, "cookie_del(c)."},
    {"ep_transports", (PyCFunction)worker_ep_transports, METH_VARARGS, "ep_transports(id) -> [(transport, device)]."},
    {"am_send_raw", (PyCFunction)worker_am_send_raw, METH_VARARGS, "am_send_raw(ep, id, header, payload) (tests)."},
    {"flush", (PyCFunction)worker_flush, METH_VARARGS, "flush(ep id) -> Xfer."},
    {"am_send", (PyCFunction)worker_am_send, METH_VARARGS, "am_send(ep id, bytes)."},
    {"am_recv", (PyCFunction)worker_am_recv, METH_VARARGS, "am_recv(timeout) -> list of received messages."},
    {"interrupt", (PyCFunction)worker_interrupt, METH_NOARGS, "Wake a thread blocked in am_recv."},
    {"stats", (PyCFunction)worker_stats, METH_NOARGS, "Counters (endpoints, pending flushes, dropped messages)."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject WorkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvx._ucx.Worker",
    .tp_basicsize = sizeof(kworker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Worker(options=None, peer_timeout=10.0): a UCP context, worker and progress thread.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)worker_init,
    .tp_dealloc = (destructor)worker_dealloc,
    .tp_methods = worker_methods,
};

/* ---- Xfer object ------------------------------------------------------------------------- */
static PyObject *xfer_new(kworker *w, xfer *x) {
    XferObject *o = PyObject_New(XferObject, &XferType);
    if (!o) return NULL;
    o->x = x;
    Py_INCREF(w);
    o->owner = (PyObject *)w;
    return (PyObject *)o;
}

static void xfer_dealloc(XferObject *o) {
    kworker *w = (kworker *)o->owner;
    if (o->x) {
        pthread_mutex_lock(&w->lk);
        xfer_unref(o->x);
        pthread_mutex_unlock(&w->lk);
        o->x = NULL;
    }
    Py_XDECREF(o->owner);
    PyObject_Free(o);
}

static PyObject *xfer_result(XferObject *o, int done, ucs_status_t st) {
    if (!done) Py_RETURN_FALSE;
    if (st != UCS_OK) return raise_ucs(st, "transfer failed");
    Py_RETURN_TRUE;
}

static PyObject *xfer_test(XferObject *o, PyObject *unused) {
    (void)unused;
    kworker *w = (kworker *)o->owner;
    pthread_mutex_lock(&w->lk);
    int done = o->x->done;
    ucs_status_t st = o->x->status;
    if (!done && !w->is_open) { done = 1; st = UCS_ERR_CANCELED; }
    pthread_mutex_unlock(&w->lk);
    return xfer_result(o, done, st);
}

static PyObject *xfer_wait(XferObject *o, PyObject *args) {
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout)) return NULL;
    kworker *w = (kworker *)o->owner;
    int done;
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lk);
    /* the waiter progresses the worker itself while its transfer moves (no thread hop, no
       turns on the lock with the progress thread, which stands aside), then, after WAIT_IDLE_S
       without progress or at its deadline, sleeps until the progress thread finishes it */
    double t0 = now_s(), until = t0 + (timeout > 0 ? timeout : 0), seen = t0, reaped = t0;
    w->spinners++;
    while (!o->x->done && w->is_open && !w->stop) {
        double t = now_s();
        if (t >= until || t - seen > WAIT_IDLE_S) break;
        if (t - reaped > WAIT_IDLE_S) { reap_failed(w); reaped = t; }
        unsigned got = ucp_worker_progress(w->worker);
        pthread_mutex_unlock(&w->lk);
        if (got) seen = now_s(); else sched_yield();
        pthread_mutex_lock(&w->lk);
    }
    if (--w->spinners == 0) pthread_cond_signal(&w->idlecv);
    if (!o->x->done && timeout > 0) {
        struct timespec ts;
        abs_deadline(&ts, timeout);
        while (!o->x->done && w->is_open && !w->stop) {
            if (pthread_cond_timedwait(&w->cv, &w->lk, &ts) == ETIMEDOUT) break;
        }
    }
    done = o->x->done;
    st = o->x->status;
    if (!done && (!w->is_open || w->stop)) { done = 1; st = UCS_ERR_CANCELED; }
    pthread_mutex_unlock(&w->lk);
    Py_END_ALLOW_THREADS
    return xfer_result(o, done, st);
}

static PyObject *xfer_get_nbytes(XferObject *o, void *c) {
    (void)c;
    return PyLong_FromUnsignedLongLong(o->x->nbytes);
}

static PyMethodDef xfer_methods[] = {
    {"test", (PyCFunction)xfer_test, METH_NOARGS, "True when done; raises kvx._ucx.Error if it failed."},
    {"wait", (PyCFunction)xfer_wait, METH_VARARGS, "wait(timeout) -> bool (GIL released)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef xfer_getset[] = {{"nbytes", (getter)xfer_get_nbytes, NULL, "bytes moved", NULL},
                                    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject XferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvx._ucx.Xfer",
    .tp_basicsize = sizeof(XferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A posted UCX transfer.",
    .tp_dealloc = (destructor)xfer_dealloc,
    .tp_methods = xfer_methods,
    .tp_getset = xfer_getset,
};

static PyObject *mod_version(PyObject *m, PyObject *unused) {
    (void)m; (void)unused;
    unsigned maj, min, rel;
    ucp_get_version(&maj, &min, &rel);
    return PyUnicode_FromFormat("%u.%u.%u", maj, min, rel);
}

static PyObject *mod_status_string(PyObject *m, PyObject *args) {
    (void)m;
    int st;
    if (!PyArg_ParseTuple(args, "i", &st)) return NULL;
    return PyUnicode_FromString(ucs_status_string((ucs_status_t)st));
}

static PyMethodDef methods[] = {
    {"version", mod_version, METH_NOARGS, "The UCX library version."},
    {"status_string", mod_status_string, METH_VARARGS, "ucs_status_string(code)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "kvx._ucx", "UCX (UCP) transfers for the kvx ucx backend.", -1,
                                 methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ucx(void) {
    if (PyType_Ready(&WorkerType) < 0 || PyType_Ready(&XferType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod);
    if (!m) return NULL;
    UcxError = PyErr_NewException("kvx._ucx.Error", PyExc_OSError, NULL);
    Py_INCREF(UcxError);
    PyModule_AddObject(m, "Error", UcxError);
    Py_INCREF(&WorkerType);
    PyModule_AddObject(m, "Worker", (PyObject *)&WorkerType);
    Py_INCREF(&XferType);
    PyModule_AddObject(m, "Xfer", (PyObject *)&XferType);
    PyModule_AddIntConstant(m, "ERR_NO_ELEM", UCS_ERR_NO_ELEM);
    PyModule_AddIntConstant(m, "ERR_CANCELED", UCS_ERR_CANCELED);
    PyModule_AddIntConstant(m, "ERR_TIMED_OUT", UCS_ERR_TIMED_OUT);
    PyModule_AddIntConstant(m, "ERR_ENDPOINT_TIMEOUT", UCS_ERR_ENDPOINT_TIMEOUT);
    PyModule_AddIntConstant(m, "ERR_CONNECTION_RESET", UCS_ERR_CONNECTION_RESET);
    PyModule_AddIntConstant(m, "ERR_UNREACHABLE", UCS_ERR_UNREACHABLE);
    PyModule_AddIntConstant(m, "ERR_REJECTED", UCS_ERR_REJECTED);
    PyModule_AddIntConstant(m, "ERR_NOT_CONNECTED", UCS_ERR_NOT_CONNECTED);
    PyModule_AddIntConstant(m, "ERR_IO_ERROR", UCS_ERR_IO_ERROR);
    PyModule_AddIntConstant(m, "ERR_INVALID_PARAM", UCS_ERR_INVALID_PARAM);
    PyModule_AddIntConstant(m, "ERR_INVALID_ADDR", UCS_ERR_INVALID_ADDR);
    PyModule_AddIntConstant(m, "AM_WREQ", AM_WREQ);
    PyModule_AddIntConstant(m, "AM_ACK", AM_ACK);
    PyModule_AddIntConstant(m, "AM_RREQ", AM_RREQ);
    PyModule_AddIntConstant(m, "AM_RDATA", AM_RDATA);
    PyModule_AddIntConstant(m, "ERR_MESSAGE_TRUNCATED", UCS_ERR_MESSAGE_TRUNCATED);
    return m;
}
