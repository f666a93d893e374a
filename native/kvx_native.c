/*
 * kvx._native: batched copies for kvx (memcpy between mapped memory, CMA between processes,
 * positional vectored file I/O), run with the GIL released on a small pthread pool.
 *
 * One entry point builds a job from descriptor arrays and index lists (bounds and lengths are
 * checked here, so Python never loops over descriptors), optionally guards it with the
 * target's published region generations, then runs it inline (small jobs) or on the pool.
 *
 * The rooms: kvx_copy.c (the copy engine and pool), kvx_jobs.c (jobs, plans, submit), kvx_gpu.c
 * (the GPU post path); kvx_native.h what they share. This file: the module.
 */
#include "kvx_native.h"

static PyMethodDef methods[] = {
    {"submit", py_submit, METH_VARARGS, "Build and start a batched copy job (int bytes if done inline, else Job)."},
    {"submit_strided", py_submit_strided, METH_VARARGS, "Build and start a memcpy job of strided descriptor pairs."},
    {"plan", py_plan, METH_VARARGS, "Build a batched copy once (same arguments as submit) for many posts."},
    {"map_fd", py_map_fd, METH_VARARGS, "mmap a file descriptor shared; returns the address."},
    {"unmap", py_unmap, METH_VARARGS, "munmap(addr, size)."},
    {"mmwrite_flags", py_mmwrite_flags, METH_VARARGS, "Get/set OP_MMWRITE's switches (MMWRITE_POPULATE, MMWRITE_RESIDENT)."},
    {"nh64", py_nh64, METH_O, "kvx-nh64 checksum of a bytes-like object (the one file jobs take with digests)."},
    {"nh64_portable", py_nh64_portable, METH_O, "kvx-nh64 through the portable code (tests)."},
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
    PyModule_AddIntConstant(m, "OP_MMREAD", OP_MMREAD);
    PyModule_AddIntConstant(m, "OP_STRIDED", OP_STRIDED);
    PyModule_AddIntConstant(m, "OP_STRIDED_CMA_WRITE", OP_STRIDED_CMA_WRITE);
    PyModule_AddIntConstant(m, "OP_STRIDED_CMA_READ", OP_STRIDED_CMA_READ);
    PyModule_AddIntConstant(m, "MMWRITE_POPULATE", MM_POPULATE);
    PyModule_AddIntConstant(m, "MMWRITE_RESIDENT", MM_RESIDENT);
    return m;
}
