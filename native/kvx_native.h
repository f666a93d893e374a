/* What the rooms of kvx._native share: build settings, includes, the job and descriptor types, and
 * the functions one room calls in another (hidden: nothing leaves the extension). */
#ifndef KVX_NATIVE_H
#define KVX_NATIVE_H

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
/* OP_MMREAD: a file -> memory through its shared mapping (src = mapped address, fd = the file's
 * descriptor and off = the file offset of src, for the preadv of runs not in the page cache) */
/* OP_STRIDED*: strided descriptor pairs (kvx_strided.c: triplet fd = count, off = dst stride, tag = src stride),
 * by memcpy, or by process_vm_writev (dst in process pid) / process_vm_readv (src in process pid) */
enum { OP_MEMCPY = 0, OP_CMA_WRITE = 1, OP_CMA_READ = 2, OP_PWRITE = 3, OP_PREAD = 4, OP_MMWRITE = 5, OP_MMREAD = 6,
       OP_STRIDED = 7, OP_STRIDED_CMA_WRITE = 8, OP_STRIDED_CMA_READ = 9 };

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

typedef struct {
    uint64_t dst, src, len; /* for file ops: dst/src is the file offset on the file side */
    int64_t fd;             /* file ops only */
    uint64_t off;           /* OP_MMWRITE with dst_off / OP_MMREAD: the file offset of the mapped side */
    int64_t tag;            /* jobs with digests: the memory side's descriptor index (where its digest goes) */
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
    uint64_t *dig; /* file jobs asked for checksums: the kvx-nh64 of each triplet's bytes (or NULL) */
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

/* OP_MMWRITE switches (kvx._native.mmwrite_flags) */
#define MM_POPULATE 1 /* madvise(MADV_POPULATE_WRITE) before the copy */
#define MM_RESIDENT 2 /* runs not in the page cache, with data on disk, go through pwritev (needs dst_off) */

#define KVX_INTERNAL __attribute__((visibility("hidden")))

/* kvx_copy.c: the copy engine, writes through file mappings, and the thread pool */
KVX_INTERNAL void job_release(job_t *j);
KVX_INTERNAL int run_range(job_t *j, size_t lo, size_t hi);
KVX_INTERNAL void guards_exit(job_t *j);
KVX_INTERNAL int guards_enter(guard_t *g, size_t ng);
KVX_INTERNAL void sync_fds(job_t *j);
KVX_INTERNAL int pool_ensure(int n);
KVX_INTERNAL int mm_install(void);
KVX_INTERNAL void sync_reset(pthread_mutex_t *mu, pthread_cond_t *cv);
KVX_INTERNAL int spawn_detached(void *(*fn)(void *));
KVX_INTERNAL PyObject *py_mmwrite_flags(PyObject *self, PyObject *args);
KVX_INTERNAL void pool_push(chunk_t *first, chunk_t *last);

/* kvx_hash.c: the kvx-nh64 block checksum, taken in the copy */
KVX_INTERNAL uint64_t copy_hash(void *dst, const void *src, size_t n, int stream);
KVX_INTERNAL PyObject *py_nh64(PyObject *self, PyObject *arg);
KVX_INTERNAL PyObject *py_nh64_portable(PyObject *self, PyObject *arg);

/* kvx_jobs.c: the Python Job and Plan objects, submit/plan, index sources, shared-page helpers */
extern KVX_INTERNAL PyTypeObject JobType;
extern KVX_INTERNAL PyTypeObject PlanType;
KVX_INTERNAL int int_buffer_width(const Py_buffer *b, int *is_signed);
KVX_INTERNAL PyObject *seq_item(PyObject *seq, Py_ssize_t i);
KVX_INTERNAL PyObject *py_submit(PyObject *self, PyObject *args);
KVX_INTERNAL PyObject *py_plan(PyObject *self, PyObject *args);
KVX_INTERNAL PyObject *py_map_fd(PyObject *self, PyObject *args);
KVX_INTERNAL PyObject *py_unmap(PyObject *self, PyObject *args);
KVX_INTERNAL PyObject *py_store64(PyObject *self, PyObject *args);
KVX_INTERNAL PyObject *py_load64(PyObject *self, PyObject *arg);
KVX_INTERNAL PyObject *py_load32(PyObject *self, PyObject *arg);
KVX_INTERNAL PyObject *py_drain(PyObject *self, PyObject *args);
KVX_INTERNAL PyObject *py_cma_probe(PyObject *self, PyObject *args);
KVX_INTERNAL PyObject *job_start(job_t *j, int nthreads, unsigned long long inline_bytes, int owned, PyObject *dig_out);

/* kvx_strided.c: copies of strided descriptors (count pieces of len bytes at a stride) */
KVX_INTERNAL int strided_range(job_t *j, size_t lo, size_t hi);
KVX_INTERNAL PyObject *py_submit_strided(PyObject *self, PyObject *args);

/* kvx_gpu.c: the cuda backend's post path: index staging, one launch sequence, event polls, routes */
extern KVX_INTERNAL PyTypeObject RouteType;
KVX_INTERNAL PyObject *py_stage_index(PyObject *self, PyObject *args);
KVX_INTERNAL PyObject *py_stage_parallel(PyObject *self, PyObject *args);
KVX_INTERNAL PyObject *py_cuda_post(PyObject *self, PyObject *args);
KVX_INTERNAL PyObject *py_cuda_event_spin(PyObject *self, PyObject *args);

#endif
