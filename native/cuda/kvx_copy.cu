// kvx batched gather/scatter copy: one launch moves every descriptor pair of a transfer.
//
// Compiled at run time with NVRTC (cupy.RawModule, see kvx/backends/cuda.py); no host code here.
//
// A transfer is n pairs (dst[didx[p]], src[sidx[p]], len). The descriptor address arrays of
// both prepared lists live on the device (uploaded once, at the first transfer that uses them);
// each transfer uploads only the two index arrays (and, for unequal lengths, a prefix array).
// Indices are int32 when every list is shorter than 2^31 (half the bytes to stage and upload),
// else int64: every kernel has both entry points (name, name_i32).
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

template <typename V, int KVX_UNROLL>
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

template <typename V, int U>
__device__ __forceinline__ void kvx_aligned_copy(char* dst, const char* src, u64 len, unsigned lane) {
    const u64 a = sizeof(V) - 1;
    u64 head = (sizeof(V) - ((u64)dst & a)) & a;
    if (head > len) head = len;
    if (lane < head) dst[lane] = src[lane];
    dst += head;
    src += head;
    len -= head;
    const u64 nv = len / sizeof(V);
    kvx_vec_copy<V, U>(dst, src, nv, lane);
    for (u64 b = nv * sizeof(V) + lane; b < len; b += 32) dst[b] = src[b];
}

template <int U>
__device__ __forceinline__ void kvx_warp_copy(char* dst, const char* src, u64 len, unsigned lane) {
    const u64 m = (u64)dst ^ (u64)src;  // co-alignment of the two pointers
    if ((m & 15) == 0) {
        kvx_aligned_copy<uint4, U>(dst, src, len, lane);
    } else if ((m & 7) == 0) {
        kvx_aligned_copy<uint2, U>(dst, src, len, lane);
    } else if ((m & 3) == 0) {
        kvx_aligned_copy<unsigned int, U>(dst, src, len, lane);
    } else {
        for (u64 b = lane; b < len; b += 32) dst[b] = src[b];
    }
}

// One work item: pair p, chunk c -> (dst, src, nbytes). Shared by the kernels below.
struct kvx_item {
    char* d;
    const char* s;
    u64 nb;
};

template <typename I, bool X = false>
__device__ __forceinline__ kvx_item kvx_locate(const u64* __restrict__ dA, const u64* __restrict__ sA,
                                              const I* __restrict__ didx, const I* __restrict__ sidx,
                                              const u64* __restrict__ L, const u64* __restrict__ F, u64 n, u64 ulen,
                                              u64 cpd, unsigned chunk_shift, u64 it) {
    u64 p, c, len;
    if (ulen) {
        if (cpd == 1) {
            p = it;
            c = 0;
        } else if (X) {  // chunk-major: warps side by side copy the same chunk of different pairs
            c = it / n;
            p = it - c * n;
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
        len = L[(u64)sidx[p]];
    }
    const u64 chunk = 1ull << chunk_shift;
    const u64 off = c << chunk_shift;
    u64 nb = len - off;
    if (nb > chunk) nb = chunk;
    kvx_item r;
    r.d = reinterpret_cast<char*>(dA[(u64)didx[p]] + off);
    r.s = reinterpret_cast<const char*>(sA[(u64)sidx[p]] + off);
    r.nb = nb;
    return r;
}

#define KVX_KERNEL_ARGS                                                                                      \
    u64 dst_addrs, u64 src_addrs, u64 idx, u64 lens, u64 first, u64 n, u64 ulen, u64 items, unsigned int chunk_shift
#define KVX_KERNEL_PASS dst_addrs, src_addrs, idx, lens, first, n, ulen, items, chunk_shift
// I: the index type (int or long long), chosen by the entry point
#define KVX_KERNEL_PROLOGUE                                                                                  \
    const u64* __restrict__ dA = reinterpret_cast<const u64*>(dst_addrs);                                   \
    const u64* __restrict__ sA = reinterpret_cast<const u64*>(src_addrs);                                   \
    const I* __restrict__ didx = reinterpret_cast<const I*>(idx);                                           \
    const I* __restrict__ sidx = didx + n;                                                                  \
    const u64* __restrict__ L = reinterpret_cast<const u64*>(lens);                                         \
    const u64* __restrict__ F = reinterpret_cast<const u64*>(first);                                        \
    const unsigned lane = threadIdx.x & 31u;                                                                \
    const u64 cpd = ulen ? (ulen + (1ull << chunk_shift) - 1) >> chunk_shift : 0;

template <typename I, int U, bool X = false>
__device__ __forceinline__ void kvx_gather_body(KVX_KERNEL_ARGS) {
    KVX_KERNEL_PROLOGUE
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 it = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; it < items; it += nwarps) {
        const kvx_item w = kvx_locate<I, X>(dA, sA, didx, sidx, L, F, n, ulen, cpd, chunk_shift, it);
        kvx_warp_copy<U>(w.d, w.s, w.nb, lane);
    }
}

// The same, with the next item's descriptors (indices, then addresses) loaded before the current
// item is copied, so their latency overlaps the copy (small blocks: one item per block).
template <typename I>
__device__ __forceinline__ void kvx_gather_pf_body(KVX_KERNEL_ARGS) {
    KVX_KERNEL_PROLOGUE
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    u64 it = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (it >= items) return;
    kvx_item w = kvx_locate(dA, sA, didx, sidx, L, F, n, ulen, cpd, chunk_shift, it);
    for (;;) {
        const u64 nx = it + nwarps;
        kvx_item nw = w;
        if (nx < items) nw = kvx_locate(dA, sA, didx, sidx, L, F, n, ulen, cpd, chunk_shift, nx);
        kvx_warp_copy<8>(w.d, w.s, w.nb, lane);
        if (nx >= items) break;
        w = nw;
        it = nx;
    }
}

// Entry points. dst_addrs/src_addrs: device arrays of u64 addresses (one per descriptor of each
// list); idx: 2n indices (int64, or int32 for the _i32 entry points): destination indices
// [0, n), then source indices [n, 2n); lens: device array of u64 lengths of the source list (used
// when ulen == 0); first: n+1 u64 prefix sums of items per pair (used when ulen == 0); ulen: the
// common length of every pair, or 0 when lengths differ.
#define KVX_ENTRY(NAME, BOUNDS, BODY)                                                                        \
    extern "C" __global__ void __launch_bounds__(BOUNDS) NAME(KVX_KERNEL_ARGS) { BODY<i64>(KVX_KERNEL_PASS); } \
    extern "C" __global__ void __launch_bounds__(BOUNDS) NAME##_i32(KVX_KERNEL_ARGS) { BODY<int>(KVX_KERNEL_PASS); }

template <typename I>
__device__ __forceinline__ void kvx_gather_u8(KVX_KERNEL_ARGS) { kvx_gather_body<I, 8>(KVX_KERNEL_PASS); }
// The same with 16 loads in flight per lane.
template <typename I>
__device__ __forceinline__ void kvx_gather_u16(KVX_KERNEL_ARGS) { kvx_gather_body<I, 16>(KVX_KERNEL_PASS); }

// Chunk-major items (equal lengths): item it = chunk it / n of pair it % n, so the warps running side
// by side copy one chunk each of different (permuted) blocks, as with small blocks, instead of the
// consecutive chunks of one block.
template <typename I>
__device__ __forceinline__ void kvx_gather_x(KVX_KERNEL_ARGS) { kvx_gather_body<I, 8, true>(KVX_KERNEL_PASS); }

// Strided pairs: pair p is count pieces of ulen bytes, piece k at dA[didx[p]] + k * DS[didx[p]] and
// sA[sidx[p]] + k * SS[sidx[p]] (a head slice of every token of a block). The arguments are the
// gather kernels': ``lens`` is the device array of source strides (one per source descriptor),
// ``first`` that of destination strides, ``ulen`` the piece length, ``items`` = n * count * cpd
// (cpd: chunks per piece), from which count follows. One warp copies one chunk of one piece: the
// host uploads one index pair per descriptor pair, the pieces are expanded here.
template <typename I>
__device__ __forceinline__ void kvx_strided_body(KVX_KERNEL_ARGS) {
    KVX_KERNEL_PROLOGUE
    const u64* __restrict__ SS = L;
    const u64* __restrict__ DS = F;
    const u64 chunk = 1ull << chunk_shift;
    const u64 per = items / n;  // count * cpd items per pair
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 it = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; it < items; it += nwarps) {
        const u64 p = it / per;
        const u64 r = it - p * per;
        const u64 k = r / cpd;
        const u64 off = (r - k * cpd) << chunk_shift;
        u64 nb = ulen - off;
        if (nb > chunk) nb = chunk;
        const u64 di = (u64)didx[p], si = (u64)sidx[p];
        char* d = reinterpret_cast<char*>(dA[di] + k * DS[di] + off);
        const char* s = reinterpret_cast<const char*>(sA[si] + k * SS[si] + off);
        kvx_warp_copy<8>(d, s, nb, lane);
    }
}

// Strided pairs of small pieces (a head slice of 128-2048 bytes per token): one warp copies a group
// of 2^chunk_shift consecutive pieces of one pair, its lanes spread over the group's 16-byte vectors
// with eight loads in flight per lane before the first store -- one descriptor lookup per group, not
// per piece. ``ulen`` carries the piece length in its low 32 bits and the count in its high 32 bits;
// ``items`` = n * ceil(count / 2^chunk_shift). A group whose addresses, strides or piece length are
// not all multiples of 16 is copied piece by piece by the warp copy.
template <typename I>
__device__ __forceinline__ void kvx_strided_group_body(KVX_KERNEL_ARGS) {
    const u64* __restrict__ dA = reinterpret_cast<const u64*>(dst_addrs);
    const u64* __restrict__ sA = reinterpret_cast<const u64*>(src_addrs);
    const I* __restrict__ didx = reinterpret_cast<const I*>(idx);
    const I* __restrict__ sidx = didx + n;
    const u64* __restrict__ SS = reinterpret_cast<const u64*>(lens);
    const u64* __restrict__ DS = reinterpret_cast<const u64*>(first);
    const unsigned lane = threadIdx.x & 31u;
    const u64 plen = ulen & 0xffffffffull;
    const u64 count = ulen >> 32;
    const u64 gpp = (count + (1ull << chunk_shift) - 1) >> chunk_shift;  // groups per pair
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 it = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; it < items; it += nwarps) {
        const u64 p = it / gpp;
        const u64 k0 = (it - p * gpp) << chunk_shift;
        u64 g = count - k0;
        if (g > (1ull << chunk_shift)) g = 1ull << chunk_shift;
        const u64 di = (u64)didx[p], si = (u64)sidx[p];
        const u64 dstr = DS[di], sstr = SS[si];
        char* d = reinterpret_cast<char*>(dA[di] + k0 * dstr);
        const char* s = reinterpret_cast<const char*>(sA[si] + k0 * sstr);
        if ((((u64)d | (u64)s | dstr | sstr | plen) & 15) == 0) {
            const unsigned vpp = (unsigned)(plen >> 4);
            const unsigned nv = (unsigned)g * vpp;
            for (unsigned j = lane; j < nv; j += 32 * 8) {
                uint4 r[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    const unsigned v = j + u * 32;
                    if (v < nv) {
                        const unsigned q = v / vpp;
                        r[u] = *reinterpret_cast<const uint4*>(s + q * sstr + ((u64)(v - q * vpp) << 4));
                    }
                }
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    const unsigned v = j + u * 32;
                    if (v < nv) {
                        const unsigned q = v / vpp;
                        *reinterpret_cast<uint4*>(d + q * dstr + ((u64)(v - q * vpp) << 4)) = r[u];
                    }
                }
            }
        } else {
            for (u64 q = 0; q < g; ++q) kvx_warp_copy<8>(d + q * dstr, s + q * sstr, plen, lane);
        }
    }
}

KVX_ENTRY(kvx_gather_copy, 256, kvx_gather_u8)
KVX_ENTRY(kvx_gather_copy_x, 256, kvx_gather_x)
KVX_ENTRY(kvx_gather_copy_u16, 256, kvx_gather_u16)
KVX_ENTRY(kvx_gather_copy_pf, 256, kvx_gather_pf_body)
KVX_ENTRY(kvx_strided_copy, 256, kvx_strided_body)
KVX_ENTRY(kvx_strided_group, 256, kvx_strided_group_body)

// Hopper (sm_90+) bulk copies: one warp per CTA (blockDim.x == 32). Lane 0 moves the 16-byte
// co-aligned part of each item with the TMA engine, global -> shared (cp.async.bulk, completion on
// an mbarrier) -> global (cp.async.bulk bulk_group), through KVX_BULK_STAGES shared buffers so the
// store of one stage overlaps the load of the next; the warp copies heads/tails and items of
// other co-alignment with plain loads/stores. Older GPUs run the warp copy for everything.
#define KVX_BULK_STAGE 16384
#define KVX_BULK_STAGES 2

template <typename I>
__device__ __forceinline__ void kvx_bulk_body(KVX_KERNEL_ARGS) {
    KVX_KERNEL_PROLOGUE
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ __align__(128) char sbuf[KVX_BULK_STAGES][KVX_BULK_STAGE];
    __shared__ __align__(8) u64 bar[KVX_BULK_STAGES];
    if (lane == 0) {
        for (int i = 0; i < KVX_BULK_STAGES; ++i) {
            const unsigned a = (unsigned)__cvta_generic_to_shared(&bar[i]);
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    unsigned k = 0;  // stages issued by this CTA
    for (u64 it = blockIdx.x; it < items; it += gridDim.x) {
        const kvx_item w = kvx_locate(dA, sA, didx, sidx, L, F, n, ulen, cpd, chunk_shift, it);
        const u64 m = (u64)w.d ^ (u64)w.s;
        if ((m & 15) != 0 || w.nb < 1024) {
            kvx_warp_copy<8>(w.d, w.s, w.nb, lane);
            continue;
        }
        u64 head = (16 - ((u64)w.d & 15)) & 15;
        const u64 body = (w.nb - head) & ~15ull;
        const u64 tail0 = head + body;
        if (lane < head) w.d[lane] = w.s[lane];
        for (u64 b = tail0 + lane; b < w.nb; b += 32) w.d[b] = w.s[b];
        if (lane == 0) {
            for (u64 off = 0; off < body; off += KVX_BULK_STAGE) {
                const unsigned sz = (unsigned)((body - off) < KVX_BULK_STAGE ? (body - off) : KVX_BULK_STAGE);
                const unsigned st = k % KVX_BULK_STAGES;
                const unsigned phase = (k / KVX_BULK_STAGES) & 1u;
                const unsigned sm = (unsigned)__cvta_generic_to_shared(&sbuf[st][0]);
                const unsigned ba = (unsigned)__cvta_generic_to_shared(&bar[st]);
                // the store that last read this stage must have read it
                asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(KVX_BULK_STAGES - 1) : "memory");
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(ba), "r"(sz) : "memory");
                asm volatile(
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sm),
                    "l"(w.s + head + off), "r"(sz), "r"(ba)
                    : "memory");
                unsigned done = 0;
                while (!done) {
                    asm volatile(
                        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                        : "=r"(done)
                        : "r"(ba), "r"(phase)
                        : "memory");
                }
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(w.d + head + off),
                             "r"(sm), "r"(sz)
                             : "memory");
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                ++k;
            }
        }
    }
    if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#else
    const u64 nwarps = gridDim.x;
    for (u64 it = blockIdx.x; it < items; it += nwarps) {
        const kvx_item w = kvx_locate(dA, sA, didx, sidx, L, F, n, ulen, cpd, chunk_shift, it);
        kvx_warp_copy<8>(w.d, w.s, w.nb, lane);
    }
#endif
}

KVX_ENTRY(kvx_bulk_copy, 32, kvx_bulk_body)
