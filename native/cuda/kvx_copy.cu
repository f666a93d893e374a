// kvx batched gather/scatter copy: one launch moves every descriptor pair of a transfer.
//
// Compiled at run time with NVRTC (cupy.RawModule, see kvx/backends/cuda.py); no host code here.
//
// A transfer is n pairs (dst[didx[p]], src[sidx[p]], len). The descriptor address arrays of
// both prepared lists live on the device (uploaded once, at the first transfer that uses them);
// each transfer uploads only the two index arrays (and, for unequal lengths, a prefix array).
//
// Work is cut into items: each pair into chunks of 2^chunk_shift bytes. One warp copies one
// item; warps walk the items grid-stride, so a few huge descriptors spread over the whole GPU
// and many small ones keep every SM busy. Inside an item a warp uses the widest access both
// pointers allow (16-byte vectors when src and dst are co-aligned, after a short head), with
// eight independent loads in flight per lane before the first store, then copies the tail
// bytewise. Any size and alignment is correct; only pointers of different alignment mod 4
// fall back to byte copies.

typedef unsigned long long u64;
typedef long long i64;

#define KVX_UNROLL 8

template <typename V>
__device__ __forceinline__ void kvx_vec_copy(char* __restrict__ dst, const char* __restrict__ src, u64 nv,
                                             unsigned lane) {
    const V* __restrict__ s = reinterpret_cast<const V*>(src);
    V* __restrict__ d = reinterpret_cast<V*>(dst);
    u64 i = lane;
    for (; i + (KVX_UNROLL - 1) * 32 < nv; i += KVX_UNROLL * 32) {
        V r[KVX_UNROLL];
#pragma unroll
        for (int u = 0; u < KVX_UNROLL; ++u) r[u] = s[i + u * 32];
#pragma unroll
        for (int u = 0; u < KVX_UNROLL; ++u) d[i + u * 32] = r[u];
    }
    for (; i < nv; i += 32) d[i] = s[i];
}

template <typename V>
__device__ __forceinline__ void kvx_aligned_copy(char* dst, const char* src, u64 len, unsigned lane) {
    const u64 a = sizeof(V) - 1;
    u64 head = (sizeof(V) - ((u64)dst & a)) & a;
    if (head > len) head = len;
    if (lane < head) dst[lane] = src[lane];
    dst += head;
    src += head;
    len -= head;
    const u64 nv = len / sizeof(V);
    kvx_vec_copy<V>(dst, src, nv, lane);
    for (u64 b = nv * sizeof(V) + lane; b < len; b += 32) dst[b] = src[b];
}

__device__ __forceinline__ void kvx_warp_copy(char* dst, const char* src, u64 len, unsigned lane) {
    const u64 m = (u64)dst ^ (u64)src;  // co-alignment of the two pointers
    if ((m & 15) == 0) {
        kvx_aligned_copy<uint4>(dst, src, len, lane);
    } else if ((m & 7) == 0) {
        kvx_aligned_copy<uint2>(dst, src, len, lane);
    } else if ((m & 3) == 0) {
        kvx_aligned_copy<unsigned int>(dst, src, len, lane);
    } else {
        for (u64 b = lane; b < len; b += 32) dst[b] = src[b];
    }
}

// dst_addrs/src_addrs: device arrays of u64 addresses (one per descriptor of each list)
// idx: 2n int64: destination indices [0, n), then source indices [n, 2n)
// lens: device array of u64 lengths of the source list (used when ulen == 0)
// first: n+1 u64 prefix sums of items per pair (used when ulen == 0)
// ulen: the common length of every pair, or 0 when lengths differ
extern "C" __global__ void __launch_bounds__(256) kvx_gather_copy(u64 dst_addrs, u64 src_addrs, u64 idx, u64 lens,
                                                                  u64 first, u64 n, u64 ulen, u64 items,
                                                                  unsigned int chunk_shift) {
    const u64* __restrict__ dA = reinterpret_cast<const u64*>(dst_addrs);
    const u64* __restrict__ sA = reinterpret_cast<const u64*>(src_addrs);
    const i64* __restrict__ didx = reinterpret_cast<const i64*>(idx);
    const i64* __restrict__ sidx = didx + n;
    const u64* __restrict__ L = reinterpret_cast<const u64*>(lens);
    const u64* __restrict__ F = reinterpret_cast<const u64*>(first);
    const unsigned lane = threadIdx.x & 31u;
    const u64 chunk = 1ull << chunk_shift;
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 cpd = ulen ? (ulen + chunk - 1) >> chunk_shift : 0;  // items per pair (uniform case)
    for (u64 it = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; it < items; it += nwarps) {
        u64 p, c, len;
        if (ulen) {
            if (cpd == 1) {
                p = it;
                c = 0;
            } else {
                p = it / cpd;
                c = it - p * cpd;
            }
            len = ulen;
        } else {
            u64 lo = 0, hi = n;  // largest p with F[p] <= it
            while (hi - lo > 1) {
                const u64 mid = (lo + hi) >> 1;
                if (F[mid] <= it) lo = mid; else hi = mid;
            }
            p = lo;
            c = it - F[p];
            len = L[sidx[p]];
        }
        const u64 off = c << chunk_shift;
        u64 nb = len - off;
        if (nb > chunk) nb = chunk;
        char* d = reinterpret_cast<char*>(dA[didx[p]] + off);
        const char* s = reinterpret_cast<const char*>(sA[sidx[p]] + off);
        kvx_warp_copy(d, s, nb, lane);
    }
}
