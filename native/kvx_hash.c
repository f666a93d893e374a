/* kvx._native, block checksums: kvx-nh64, a 64-bit hash taken in the same pass as a copy.
 *
 * The function (kvx.checksum.nh64_reference in Python is the executable specification):
 *   - 64 keys K[0..63]: splitmix64 from the seed 0x6b76782d6e683634 ("kvx-nh64").
 *   - four 64-bit accumulators, acc[i] = K[56 + i] at the start.
 *   - the input is cut into 32-byte stripes (a short last stripe is padded with zero bytes), read as
 *     four little-endian 64-bit words w[0..3]; stripe s uses the keys k = K[4 * (s % 16) + i]:
 *         d = w[i] ^ k;  acc[i] += lo32(d) * hi32(d);  acc[i] += w[i ^ 1]          (mod 2^64)
 *   - after every 16th stripe (512 bytes; not after the last stripe of the input):
 *         acc[i] ^= acc[i] >> 47;  acc[i] ^= K[i];  acc[i] *= 0x9E3779B1            (mod 2^64)
 *   - h = len * 0x9E3779B97F4A7C15; for i in 0..3: h = (h ^ fmix(acc[i] ^ K[60 + i])) * 0xC2B2AE3D27D4EB4F;
 *     the result is fmix(h), fmix being the murmur3 64-bit finalizer.
 * The per-stripe keys make the sum depend on each word's position inside a 512-byte block and the
 * multiply after each block makes it depend on the block order; every input bit enters a lane
 * linearly (the added word) as well as through a product.
 *
 * copy_hash copies and hashes in one pass: each 32-byte stripe is loaded once, stored to the
 * destination (non-temporal stores for large copies) and folded into the accumulators from the same
 * register, so the checksum is of exactly the bytes stored. AVX2 where the CPU has it; the portable
 * version computes the same function. */
#include "kvx_native.h"

#define NH_SEED 0x6b76782d6e683634ULL
#define NH_P32 0x9E3779B1ULL
#define NH_LEN 0x9E3779B97F4A7C15ULL
#define NH_FIN 0xC2B2AE3D27D4EB4FULL

static uint64_t nh_key[64];
static pthread_once_t nh_once = PTHREAD_ONCE_INIT;
#if defined(__x86_64__)
static int nh_avx2 = 0;
#endif

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static uint64_t fmix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static void nh_init(void) {
    uint64_t x = NH_SEED;
    for (int i = 0; i < 64; i++) nh_key[i] = splitmix64(&x);
#if defined(__x86_64__)
    nh_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
}

static uint64_t nh_final(const uint64_t acc[4], uint64_t len) {
    uint64_t h = len * NH_LEN;
    for (int i = 0; i < 4; i++) h = (h ^ fmix(acc[i] ^ nh_key[60 + i])) * NH_FIN;
    return fmix(h);
}

static inline uint64_t ld64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* x86 and the other little-endian targets kvx builds on */
    return v;
}

/* one stripe into acc (portable) */
static inline void nh_stripe(uint64_t acc[4], const unsigned char *p, unsigned s) {
    const uint64_t *k = nh_key + 4 * (s & 15);
    uint64_t w[4] = {ld64(p), ld64(p + 8), ld64(p + 16), ld64(p + 24)};
    for (int i = 0; i < 4; i++) {
        uint64_t d = w[i] ^ k[i];
        acc[i] += (d & 0xffffffffULL) * (d >> 32) + w[i ^ 1];
    }
}

static inline void nh_scramble(uint64_t acc[4]) {
    for (int i = 0; i < 4; i++) {
        acc[i] ^= acc[i] >> 47;
        acc[i] ^= nh_key[i];
        acc[i] *= NH_P32;
    }
}

/* The hash of the stripes of [p, p + n) from stripe s on, into acc; returns the next stripe number.
 * Full stripes only, and never the scramble after the input's last stripe (the caller passes the
 * stripes in order and `last` marks the final call). */
static unsigned nh_run(uint64_t acc[4], const unsigned char *p, size_t nstripes, unsigned s, int last) {
    for (size_t q = 0; q < nstripes; q++, s++) {
        nh_stripe(acc, p + 32 * q, s);
        if ((s & 15) == 15 && !(last && q + 1 == nstripes)) nh_scramble(acc);
    }
    return s;
}

/* copy (optional) and hash, portable */
static uint64_t copy_hash_portable(void *dst, const void *src, size_t n) {
    const unsigned char *p = src;
    if (dst) memcpy(dst, src, n);
    uint64_t acc[4] = {nh_key[56], nh_key[57], nh_key[58], nh_key[59]};
    size_t full = n / 32, rest = n % 32;
    unsigned s = nh_run(acc, p, full, 0, rest == 0);
    if (rest) {
        unsigned char pad[32] = {0};
        memcpy(pad, p + 32 * full, rest);
        nh_run(acc, pad, 1, s, 1);
    }
    return nh_final(acc, n);
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static uint64_t copy_hash_avx2(void *dst, const void *src, size_t n, int stream) {
    const unsigned char *p = src;
    unsigned char *d = dst;
    __m256i acc = _mm256_setr_epi64x((long long)nh_key[56], (long long)nh_key[57], (long long)nh_key[58],
                                     (long long)nh_key[59]);
    const __m256i scr = _mm256_setr_epi64x((long long)nh_key[0], (long long)nh_key[1], (long long)nh_key[2],
                                           (long long)nh_key[3]);
    const __m256i p32 = _mm256_set1_epi64x((long long)NH_P32);
    size_t full = n / 32, rest = n % 32;
    /* non-temporal stores need a 32-byte aligned destination */
    const int nt = dst && stream && ((uintptr_t)d & 31) == 0;
    unsigned s = 0;
    for (size_t q = 0; q < full; q++, s++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(p + 32 * q));
        if (nt) _mm256_stream_si256((__m256i *)(d + 32 * q), w);
        else if (dst) _mm256_storeu_si256((__m256i *)(d + 32 * q), w);
        const __m256i k = _mm256_loadu_si256((const __m256i *)(nh_key + 4 * (s & 15)));
        const __m256i x = _mm256_xor_si256(w, k);
        acc = _mm256_add_epi64(acc, _mm256_mul_epu32(x, _mm256_srli_epi64(x, 32)));
        acc = _mm256_add_epi64(acc, _mm256_permute4x64_epi64(w, _MM_SHUFFLE(2, 3, 0, 1)));
        if ((s & 15) == 15 && !(rest == 0 && q + 1 == full)) {
            acc = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
            acc = _mm256_xor_si256(acc, scr);
            const __m256i lo = _mm256_mul_epu32(acc, p32);
            const __m256i hi = _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(acc, 32), p32), 32);
            acc = _mm256_add_epi64(lo, hi);
        }
    }
    uint64_t a[4];
    _mm256_storeu_si256((__m256i *)a, acc);
    if (rest) {
        unsigned char pad[32] = {0};
        memcpy(pad, p + 32 * full, rest);
        if (dst) memcpy(d + 32 * full, p + 32 * full, rest);
        nh_run(a, pad, 1, s, 1);
    }
    return nh_final(a, n);
}
#endif

/* Copy n bytes from src to dst (dst may be NULL: hash only) and return the kvx-nh64 of the bytes. With
 * stream, large aligned copies use non-temporal stores (the caller fences before publishing). */
uint64_t copy_hash(void *dst, const void *src, size_t n, int stream) {
    pthread_once(&nh_once, nh_init);
#if defined(__x86_64__)
    if (nh_avx2) return copy_hash_avx2(dst, src, n, stream);
#endif
    (void)stream;
    return copy_hash_portable(dst, src, n);
}

/* nh64(buffer) -> int: the kvx-nh64 of a bytes-like object (tests and tools; the GIL is released for
 * large inputs) */
PyObject *py_nh64(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    uint64_t h;
    if (b.len >= 65536) {
        Py_BEGIN_ALLOW_THREADS
        h = copy_hash(NULL, b.buf, (size_t)b.len, 0);
        Py_END_ALLOW_THREADS
    } else {
        h = copy_hash(NULL, b.buf, (size_t)b.len, 0);
    }
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

/* nh64_portable(buffer) -> int: the same through the portable code (tests compare the two) */
PyObject *py_nh64_portable(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    pthread_once(&nh_once, nh_init);
    uint64_t h = copy_hash_portable(NULL, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}
