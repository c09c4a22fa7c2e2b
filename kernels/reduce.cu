// gpuring device kernels, compiled at run time (CuPy RawModule / NVRTC) or by nvcc.
//
//   gpuring_reduce_<dtype>_<op>(dst, a, b, n, divisor, abort)
//       dst[i] = op(a[i], b[i]), then / divisor when divisor != 1 (avg = sum + divisor).
//       ops: sum, prod, min, max (complex: sum, prod). dst may alias a or b.
//   gpuring_reduce_n_<dtype>_<op>(dst, s0, ..., s7, nsrc, n, divisor, abort)
//       dst[i] = s0[i] op s1[i] op ... op s<nsrc-1>[i] for 1 <= nsrc <= 8, folded in that
//       order with every step rounded as the binary kernel rounds it and the divisor at the
//       last step only: the bits of the chain dst = s0 op s1, dst = dst op s2, ... Unused
//       source pointers are never read. Longer folds run as several launches, each after
//       the first starting from dst. dst may alias any source.
//   gpuring_copy_bytes(dst, src, nbytes, abort)
//   gpuring_wait_flag(flag, value, timeout_ns, status, abort) one thread, spin fallback
//   gpuring_write_flag(flag, value, abort)                     one thread
//
// `abort` is a word in device memory that the host sets when the communicator fails (and a
// spinning wait sets when it times out). From then on every kernel returns at once: data
// kernels read nothing (a dead peer's memory may be gone) and flag writes publish nothing
// (data computed after a failure must never reach a peer). The host also releases the
// streams' pending flag waits then, so queued work drains through these no-op kernels.
//
// Every kernel is `extern "C"`, so its name is the symbol (no name mangling, no
// name_expressions needed). Kernel names are listed in gpuring/devices/_kernels.py.
//
// Arithmetic rules (the same bits on every rank; the host device follows them too, and
// tests/unit/test_kernels_on_host.py runs these kernels on the CPU against it):
// - integers wrap modulo 2^bits (computed in unsigned 64-bit: no signed-overflow UB);
//   division truncates toward zero like C.
// - float16 and bfloat16 are computed in float32 (op, then the division) and rounded once.
// - min/max propagate NaN like numpy.minimum/maximum.
// - complex multiply uses explicitly rounded operations, so no FMA contraction changes bits
//   (NumPy's complex multiply may use FMA, so the host device can differ in the last bit).
// - complex avg divides each part by the divisor.
// The vectorised and the scalar paths call the same element function, so a piece gives the
// same bits whatever its alignment.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned long long u64;

// ---------------------------------------------------------------------------------------
// Complex types: plain structs with the layout of numpy complex64 / complex128.
struct __align__(8) cfloat {
    float re, im;
};
struct __align__(16) cdouble {
    double re, im;
};

// ---------------------------------------------------------------------------------------
// Traits. Arith<T>: type that + and * run in (wraps modulo 2^64 for integers).
// Quot<T>: type that the division by the divisor runs in.
template <typename T> struct Arith { typedef T type; };
template <typename T> struct Quot { typedef T type; };

#define GPURING_INT_TRAITS(T, QUOT) \
    template <> struct Arith<T> { typedef u64 type; }; \
    template <> struct Quot<T> { typedef QUOT type; };

GPURING_INT_TRAITS(signed char, long long)
GPURING_INT_TRAITS(short, long long)
GPURING_INT_TRAITS(int, long long)
GPURING_INT_TRAITS(long long, long long)
GPURING_INT_TRAITS(unsigned char, u64)
GPURING_INT_TRAITS(unsigned short, u64)
GPURING_INT_TRAITS(unsigned int, u64)
GPURING_INT_TRAITS(u64, u64)
#undef GPURING_INT_TRAITS

// Correctly rounded float ops that the compiler may not fuse into an FMA.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <typename C>
__device__ __forceinline__ C complex_mul(C a, C b) {
    C r;
    r.re = add_rn(mul_rn(a.re, b.re), -mul_rn(a.im, b.im));
    r.im = add_rn(mul_rn(a.re, b.im), mul_rn(a.im, b.re));
    return r;
}

template <typename C>
__device__ __forceinline__ C complex_add(C a, C b) {
    C r;
    r.re = a.re + b.re;
    r.im = a.im + b.im;
    return r;
}

// ---------------------------------------------------------------------------------------
// Operators: apply(a, b) on real types (float16 comes here as float).
struct OpSum {
    template <typename T>
    __device__ static T apply(T a, T b) {
        typedef typename Arith<T>::type A;
        return (T)((A)a + (A)b);
    }
    __device__ static cfloat apply(cfloat a, cfloat b) { return complex_add(a, b); }
    __device__ static cdouble apply(cdouble a, cdouble b) { return complex_add(a, b); }
};

struct OpProd {
    template <typename T>
    __device__ static T apply(T a, T b) {
        typedef typename Arith<T>::type A;
        return (T)((A)a * (A)b);
    }
    __device__ static cfloat apply(cfloat a, cfloat b) { return complex_mul(a, b); }
    __device__ static cdouble apply(cdouble a, cdouble b) { return complex_mul(a, b); }
};

// `x != x` is true only for NaN (always false for integers).
struct OpMin {
    template <typename T>
    __device__ static T apply(T a, T b) {
        if (a != a) return a;
        if (b != b) return b;
        return b < a ? b : a;
    }
};

struct OpMax {
    template <typename T>
    __device__ static T apply(T a, T b) {
        if (a != a) return a;
        if (b != b) return b;
        return a < b ? b : a;
    }
};

// ---------------------------------------------------------------------------------------
// One element: op, then the division. Specialised for float16 and complex.
template <typename Op, typename T>
__device__ __forceinline__ T combine(T a, T b, long long divisor) {
    T r = Op::apply(a, b);
    if (divisor != 1) {
        typedef typename Quot<T>::type Q;
        r = (T)((Q)r / (Q)divisor);
    }
    return r;
}

template <typename Op>
__device__ __forceinline__ __half combine(__half a, __half b, long long divisor) {
    float r = Op::apply(__half2float(a), __half2float(b));
    if (divisor != 1) r = r / (float)divisor;
    return __float2half_rn(r);
}

template <typename Op>
__device__ __forceinline__ __nv_bfloat16 combine(__nv_bfloat16 a, __nv_bfloat16 b,
                                                 long long divisor) {
    float r = Op::apply(__bfloat162float(a), __bfloat162float(b));
    if (divisor != 1) r = r / (float)divisor;
    return __float2bfloat16_rn(r);
}

template <typename Op>
__device__ __forceinline__ cfloat combine(cfloat a, cfloat b, long long divisor) {
    cfloat r = Op::apply(a, b);
    if (divisor != 1) {
        r.re = r.re / (float)divisor;
        r.im = r.im / (float)divisor;
    }
    return r;
}

template <typename Op>
__device__ __forceinline__ cdouble combine(cdouble a, cdouble b, long long divisor) {
    cdouble r = Op::apply(a, b);
    if (divisor != 1) {
        r.re = r.re / (double)divisor;
        r.im = r.im / (double)divisor;
    }
    return r;
}

template <typename Op>
struct Combine {
    long long divisor;
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const { return combine<Op>(a, b, divisor); }
};

struct TakeFirst {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T) const { return a; }
};

// ---------------------------------------------------------------------------------------
// Element-wise driver: a grid-stride loop over n elements of a `Body` (what one element and
// one pack of elements do; see BinaryBody). It moves W-byte packs for the widest W of 16, 8
// and 4 bytes (at least one element) at which every operand has the same offset modulo W, a
// whole number of elements: a scalar head reaches W-byte alignment, the body moves packs,
// a scalar tail finishes. Operands that share no such offset run scalar throughout.
// GPURING_VECTOR_WIDTH(W) reports the width chosen (0: scalar); a no-op on the GPU, the
// host build of the tests records it.
#ifndef GPURING_VECTOR_WIDTH
#define GPURING_VECTOR_WIDTH(W)
#endif

template <typename T, int W>
struct alignas(W) Vec {
    static const int N = W / sizeof(T);
    T v[N];
};

// True when every pointer has dst's offset modulo W, and that offset is whole elements.
template <typename T, int W, int K>
__device__ __forceinline__ bool same_offset(const void* const (&ptrs)[K], int count) {
    const u64 mis = (u64)ptrs[0] % W;
    bool same = mis % sizeof(T) == 0;
#pragma unroll
    for (int k = 1; k < K; ++k) same = same && (k >= count || (u64)ptrs[k] % W == mis);
    return same;
}

template <typename T, int W, typename Body>
__device__ __forceinline__ void vector_loop(const Body& body, u64 n, u64 tid, u64 stride) {
    const int N = Vec<T, W>::N;
    u64 head = ((W - (u64)body.dst % W) % W) / sizeof(T);
    if (head > n) head = n;
    const u64 npacks = (n - head) / N;
    const u64 tail = head + npacks * N;
    for (u64 i = tid; i < head; i += stride) body.scalar(i);
    for (u64 p = tid; p < npacks; p += stride) body.template pack<W>(head + p * N);
    for (u64 i = tail + tid; i < n; i += stride) body.scalar(i);
}

// The loop at width W when every operand allows it; false (nothing done) otherwise.
template <typename T, int W, typename Body>
__device__ __forceinline__ bool try_width(const Body& body, u64 n, u64 tid, u64 stride) {
    if constexpr (W < sizeof(T)) {
        return false;
    } else {
        if (!same_offset<T, W>(body.ptrs, body.count)) return false;
        GPURING_VECTOR_WIDTH(W);
        vector_loop<T, W>(body, n, tid, stride);
        return true;
    }
}

// The loop over n elements by the threads tid, tid + stride, ... (the whole grid, or one block).
template <typename T, typename Body>
__device__ void elementwise_by(const Body& body, u64 n, u64 tid, u64 stride) {
    if (try_width<T, 16>(body, n, tid, stride)) return;
    if (try_width<T, 8>(body, n, tid, stride)) return;
    if (try_width<T, 4>(body, n, tid, stride)) return;
    GPURING_VECTOR_WIDTH(0);
    for (u64 i = tid; i < n; i += stride) body.scalar(i);
}

template <typename T, typename Body>
__device__ void elementwise(const Body& body, u64 n) {
    elementwise_by<T>(body, n, (u64)blockIdx.x * blockDim.x + threadIdx.x,
                      (u64)gridDim.x * blockDim.x);
}

template <typename T, int W>
__device__ __forceinline__ Vec<T, W> load_pack(const T* p, u64 i) {
    return *reinterpret_cast<const Vec<T, W>*>(p + i);
}

// dst[i] = f(a[i], b[i]). dst may alias a or b (each element is read, then written, by the
// same thread).
template <typename T, typename F>
struct BinaryBody {
    T* dst;
    const T* a;
    const T* b;
    F f;
    const void* ptrs[3];
    static const int count = 3;

    __device__ BinaryBody(T* d, const T* x, const T* y, F fn)
        : dst(d), a(x), b(y), f(fn), ptrs{d, x, y} {}

    __device__ __forceinline__ void scalar(u64 i) const { dst[i] = f(a[i], b[i]); }

    template <int W>
    __device__ __forceinline__ void pack(u64 i) const {
        Vec<T, W> x = load_pack<T, W>(a, i);
        const Vec<T, W> y = load_pack<T, W>(b, i);
#pragma unroll
        for (int k = 0; k < Vec<T, W>::N; ++k) x.v[k] = f(x.v[k], y.v[k]);
        *reinterpret_cast<Vec<T, W>*>(dst + i) = x;
    }
};

// dst[i] = src[0][i] op src[1][i] op ... op src[nsrc-1][i], folded left in source order
// and rounded to T after every step, the divisor applied at the last step only: exactly
// what the chain of binary reduces dst = s0 op s1, dst = dst op s2, ... computes, reading
// each source once and writing dst once. dst may be the same memory as any source.
// The loop over the sources is not unrolled (src is indexed at run time, from a 64-byte
// array in local memory): unrolled, every pack loop compiles 8 times and NVRTC takes
// several times longer over reduce.cu.
#define GPURING_MAX_SOURCES 8

template <typename T, typename Op>
struct FoldBody {
    T* dst;
    const T* const* src;
    int nsrc;
    long long divisor;
    const void* ptrs[GPURING_MAX_SOURCES + 1];
    int count;

    __device__ FoldBody(T* d, const T* const* s, int k, long long div)
        : dst(d), src(s), nsrc(k), divisor(div), count(k + 1) {
        ptrs[0] = d;
#pragma unroll
        for (int j = 0; j < GPURING_MAX_SOURCES; ++j) ptrs[j + 1] = j < k ? s[j] : nullptr;
    }

    // The divisor of step j (folding in src[j]): only the last step divides.
    __device__ __forceinline__ long long step_divisor(int j) const {
        return j == nsrc - 1 ? divisor : 1;
    }

    __device__ __forceinline__ void scalar(u64 i) const {
        T acc = src[0][i];
#pragma unroll 1
        for (int j = 1; j < nsrc; ++j) acc = combine<Op>(acc, src[j][i], step_divisor(j));
        dst[i] = acc;
    }

    template <int W>
    __device__ __forceinline__ void pack(u64 i) const {
        Vec<T, W> acc = load_pack<T, W>(src[0], i);
#pragma unroll 1
        for (int j = 1; j < nsrc; ++j) {
            const Vec<T, W> y = load_pack<T, W>(src[j], i);
            const long long d = step_divisor(j);
#pragma unroll
            for (int k = 0; k < Vec<T, W>::N; ++k) acc.v[k] = combine<Op>(acc.v[k], y.v[k], d);
        }
        *reinterpret_cast<Vec<T, W>*>(dst + i) = acc;
    }
};

// The fold of `nsrc` sources into dst over n elements by the threads tid, tid + stride, ...:
// one function per (dtype, op), called (not inlined) by the n-input kernel and by the
// one-kernel collectives, so that NVRTC compiles its vector loops once.
template <typename T, typename Op>
__device__ __noinline__ void fold_by(T* dst, const T* const* src, int nsrc, long long divisor,
                                     u64 n, u64 tid, u64 stride) {
    elementwise_by<T>(FoldBody<T, Op>(dst, src, nsrc, divisor), n, tid, stride);
}

// ---------------------------------------------------------------------------------------
// Reduce kernels: two extern "C" kernels per (dtype, op), binary and n-input.
#define GPURING_REDUCE(NAME, T, OPNAME, OP) \
    extern "C" __global__ void gpuring_reduce_##NAME##_##OPNAME( \
        T* dst, const T* a, const T* b, u64 n, long long divisor, const volatile int* abort) { \
        if (*abort) return; \
        Combine<OP> f = {divisor}; \
        elementwise<T>(BinaryBody<T, Combine<OP> >(dst, a, b, f), n); \
    } \
    extern "C" __global__ void gpuring_reduce_n_##NAME##_##OPNAME( \
        T* dst, const T* s0, const T* s1, const T* s2, const T* s3, const T* s4, const T* s5, \
        const T* s6, const T* s7, int nsrc, u64 n, long long divisor, \
        const volatile int* abort) { \
        if (*abort || nsrc < 1 || nsrc > GPURING_MAX_SOURCES) return; \
        const T* const src[GPURING_MAX_SOURCES] = {s0, s1, s2, s3, s4, s5, s6, s7}; \
        fold_by<T, OP>(dst, src, nsrc, divisor, n, (u64)blockIdx.x * blockDim.x + threadIdx.x, \
                       (u64)gridDim.x * blockDim.x); \
    }

#define GPURING_REDUCE_REAL(NAME, T) \
    GPURING_REDUCE(NAME, T, sum, OpSum) \
    GPURING_REDUCE(NAME, T, prod, OpProd) \
    GPURING_REDUCE(NAME, T, min, OpMin) \
    GPURING_REDUCE(NAME, T, max, OpMax)

#define GPURING_REDUCE_COMPLEX(NAME, T) \
    GPURING_REDUCE(NAME, T, sum, OpSum) \
    GPURING_REDUCE(NAME, T, prod, OpProd)

GPURING_REDUCE_REAL(int8, signed char)
GPURING_REDUCE_REAL(int16, short)
GPURING_REDUCE_REAL(int32, int)
GPURING_REDUCE_REAL(int64, long long)
GPURING_REDUCE_REAL(uint8, unsigned char)
GPURING_REDUCE_REAL(uint16, unsigned short)
GPURING_REDUCE_REAL(uint32, unsigned int)
GPURING_REDUCE_REAL(uint64, u64)
GPURING_REDUCE_REAL(float16, __half)
GPURING_REDUCE_REAL(bfloat16, __nv_bfloat16)
GPURING_REDUCE_REAL(float32, float)
GPURING_REDUCE_REAL(float64, double)
GPURING_REDUCE_COMPLEX(complex64, cfloat)
GPURING_REDUCE_COMPLEX(complex128, cdouble)

#undef GPURING_REDUCE_COMPLEX
#undef GPURING_REDUCE_REAL
#undef GPURING_REDUCE

// ---------------------------------------------------------------------------------------
// Byte copy (packs of 16, 8 or 4 bytes when src and dst share that alignment).
extern "C" __global__ void gpuring_copy_bytes(unsigned char* dst, const unsigned char* src,
                                              u64 nbytes, const volatile int* abort) {
    if (*abort) return;
    elementwise<unsigned char>(BinaryBody<unsigned char, TakeFirst>(dst, src, src, TakeFirst()),
                               nbytes);
}

// ---------------------------------------------------------------------------------------
// Flags: 64-bit words, values only grow. Launch both with one block of one thread.

// Nanoseconds of the GPU global timer.
__device__ __forceinline__ u64 global_ns() {
#ifdef __CUDA_ARCH__
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#else
    return gpuring_host_globaltimer();  // host emulation of the kernels (tests)
#endif
}

// Hold the stream until *flag >= value. Gives up after `timeout_ns` nanoseconds (0: never)
// and then sets *status = 1 and *abort = 1, so that nothing queued after it runs; returns
// at once while *status is non-zero (the host sets it to abort), setting *abort too (in
// stream order, whether or not the host's own write of it has landed yet). `status` lives
// in mapped pinned host memory, so the host sees it without a copy.
extern "C" __global__ void gpuring_wait_flag(volatile u64* flag, u64 value, u64 timeout_ns,
                                             volatile int* status, volatile int* abort) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const u64 start = global_ns();
    unsigned int sleep_ns = 32;
    while (*flag < value) {
        if (*status != 0) {  // aborted by the host: nothing queued after this may run
            *abort = 1;
            __threadfence_system();
            break;
        }
        if (timeout_ns != 0 && global_ns() - start > timeout_ns) {
            *abort = 1;
            __threadfence_system();
            *status = 1;
            break;
        }
        __nanosleep(sleep_ns);
        if (sleep_ns < 1024) sleep_ns *= 2;
    }
    // Acquire: later kernels of this stream read what the writer published before the flag.
    __threadfence_system();
}

// *flag = value once everything before it in the stream is visible to every peer. The flag
// may be a peer's (producers write into their readers' memory). Values only grow: a write
// never lowers a word (the host releases a failed rank's waits by raising its words to the
// largest value, and a late writer must not undo that).
extern "C" __global__ void gpuring_write_flag(volatile u64* flag, u64 value,
                                              const volatile int* abort) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    // After an abort or a timed-out wait, the data before this point may be garbage: never
    // publish it.
    if (*abort) return;
    __threadfence_system();
    if (*flag < value) *flag = value;
    __threadfence_system();
}

// gpuring_write_flag for up to GPURING_MAX_FLAGS flags at once (the first `count`), all to
// `value`: one launch where a rank tells every peer the same thing (a round done, a piece ready
// for several readers). One fence makes everything before it visible to all of them.
#define GPURING_MAX_FLAGS 8
extern "C" __global__ void gpuring_write_flags(volatile u64* f0, volatile u64* f1,
                                               volatile u64* f2, volatile u64* f3,
                                               volatile u64* f4, volatile u64* f5,
                                               volatile u64* f6, volatile u64* f7, int count,
                                               u64 value, const volatile int* abort) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (*abort) return;
    volatile u64* flags[GPURING_MAX_FLAGS] = {f0, f1, f2, f3, f4, f5, f6, f7};
    __threadfence_system();
    for (int i = 0; i < count && i < GPURING_MAX_FLAGS; ++i) {
        if (*flags[i] < value) *flags[i] = value;
    }
    __threadfence_system();
}

// ---------------------------------------------------------------------------------------
// One-kernel collectives of small arrays (the fused path): every rank launches
//
//   gpuring_fused_<dtype>_<op>(out, in, n, stride, divisor, kind, root, rank, nranks,
//                               r0, ..., r7, slot_bytes, timeout_ns, status, abort)
//
// once, with the same grid on every rank. kind: all_reduce, reduce_scatter, all_gather,
// broadcast, reduce, gather, scatter or all_to_all (GPURING_ALL_REDUCE ...); n: the
// elements block ranges split (see fused_collective); stride: the elements from one rank's
// block to the next in an array that holds a block per rank (the input of reduce_scatter,
// scatter and all_to_all, the output of all_gather, gather and all_to_all): n, or more where
// the call is one piece of a larger collective (whose blocks are `stride` long). Reductions fold in rank order, every step rounded as gpuring_reduce_n
// rounds it, the divisor at the last step: the same bits on every rank and as the other
// paths (the copies use the uint8 instance, n in bytes). r<q> is rank q's fused region,
// mapped into this process (r<rank> is this rank's own); the first `nranks` are used. A
// region is
//
//   [epoch: the calls done | blocks done in this call | ... | inbox at GPURING_FUSED_INBOX:
//    MAX_BLOCKS x MAX_RANKS words | data at GPURING_FUSED_DATA: two slots of slot_bytes]
//
// and the same on every rank. The call's epoch e is the count of calls done, plus one, kept on
// the device (the last block to finish moves it on), so a CUDA graph replays the kernel
// correctly: nothing in its arguments changes from call to call. Block b handles one
// contiguous range of the elements:
// (1) it copies its range of what the peers read of this rank into its slot e % 2 (the
//     input; every rank's block of it for reduce_scatter, scatter and all_to_all; nothing
//     off the root of a broadcast or a scatter, nor on the root of a gather);
// (2) thread q (q != rank) tells rank q "block b published epoch e" in rank q's inbox, with
//     a system-scope fence first (the copy is visible before the flag), then waits until
//     rank q's block b said the same in this rank's inbox (fence after: acquire);
// (3) makes its range of this rank's output from every rank's slot (its own part straight
//     from `in`): a fold in rank order, or copies (nothing off the root of a reduce or a
//     gather).
// Slot e % 2 is written again at epoch e + 2 only after this rank finished call e + 1, in
// which it heard every peer start call e + 1, so finish call e, the last that read the slot:
// no rank overwrites data a peer still reads, whatever the grids of the calls. The grid must
// fit on the GPU at once (every block waits for the peers' block of the same index).
// Waits give up after timeout_ns (then status[0] = 1, status[1] = 1 + the peer waited for,
// and *abort = 1), and return when the host sets the abort word or status[0]; the block then
// writes nothing into out and publishes nothing. Launch with at least `nranks` threads a
// block.
#define GPURING_FUSED_MAX_BLOCKS 32
#define GPURING_FUSED_MAX_RANKS GPURING_MAX_SOURCES
#define GPURING_FUSED_INBOX (8 * GPURING_FUSED_MAX_BLOCKS)
#define GPURING_FUSED_DATA 4096

__device__ __forceinline__ u64 min_u64(u64 a, u64 b) { return a < b ? a : b; }

// Thread `peer` of a block: publish this block's epoch to `peer` and wait for the peer's.
// Returns false when the wait gave up (timeout or abort).
__device__ __noinline__ bool fused_handshake(unsigned char* const* regions, int rank,
                                                int peer, unsigned block, u64 epoch,
                                                u64 timeout_ns, volatile int* status,
                                                volatile int* abort) {
    volatile u64* to = reinterpret_cast<volatile u64*>(regions[peer] + GPURING_FUSED_INBOX) +
                       block * GPURING_FUSED_MAX_RANKS + rank;
    volatile u64* from =
        reinterpret_cast<volatile u64*>(regions[rank] + GPURING_FUSED_INBOX) +
        block * GPURING_FUSED_MAX_RANKS + peer;
    if (*abort) return false;  // nothing is published after a failure
    __threadfence_system();  // release: the block's copy (ordered by the barrier) first
    *to = epoch;
    const u64 start = global_ns();
    unsigned int sleep_ns = 32;
    for (unsigned int spin = 1; *from < epoch; ++spin) {
        // the abort word (device memory) every time, the host's status word (over PCIe)
        // now and then: the host sets the abort word first
        if (*abort || (spin % 64 == 0 && *status != 0)) {
            *abort = 1;
            __threadfence_system();
            return false;
        }
        if (timeout_ns != 0 && global_ns() - start > timeout_ns) {
            *abort = 1;
            status[1] = 1 + peer;
            __threadfence_system();  // the peer before the verdict the host reads first
            status[0] = 1;
            __threadfence_system();
            return false;
        }
        __nanosleep(sleep_ns);
        if (sleep_ns < 256) sleep_ns *= 2;
    }
    __threadfence_system();  // acquire: the peer's slot as it published it
    return true;
}

// A block's bytes from `src` to `dst` (its threads; any alignment).
__device__ __noinline__ void block_copy(unsigned char* dst, const unsigned char* src,
                                           u64 nbytes) {
    elementwise_by<unsigned char>(BinaryBody<unsigned char, TakeFirst>(dst, src, src,
                                                                       TakeFirst()),
                                  nbytes, threadIdx.x, blockDim.x);
}

// The collectives one kernel runs (`kind`); `n` is what block ranges split: the elements
// of the array (all_reduce, reduce, broadcast), of each rank's block (reduce_scatter,
// scatter: of the output; all_gather, gather: of the input; all_to_all: of either).
#define GPURING_ALL_REDUCE 0
#define GPURING_REDUCE_SCATTER 1
#define GPURING_ALL_GATHER 2
#define GPURING_BROADCAST 3
#define GPURING_REDUCE 4
#define GPURING_GATHER 5
#define GPURING_SCATTER 6
#define GPURING_ALL_TO_ALL 7

template <typename T, typename Op>
__device__ void fused_collective(T* out, const T* in, u64 n, u64 stride, long long divisor,
                                 int kind,
                                 int root, int rank, int nranks,
                                 unsigned char* const* regions, u64 slot_bytes,
                                 u64 timeout_ns, volatile int* status, volatile int* abort) {
    __shared__ u64 epoch;
    __shared__ int failed;
    if (nranks < 1 || nranks > GPURING_FUSED_MAX_RANKS || rank < 0 || rank >= nranks ||
        root < 0 || root >= nranks || kind < GPURING_ALL_REDUCE || kind > GPURING_ALL_TO_ALL ||
        gridDim.x > GPURING_FUSED_MAX_BLOCKS || blockDim.x < nranks || stride < n)
        return;
    const unsigned b = blockIdx.x;
    volatile u64* done_calls = reinterpret_cast<volatile u64*>(regions[rank]);
    if (threadIdx.x == 0) {  // one reading of the abort word for the whole block
        epoch = *done_calls + 1;
        failed = *abort != 0;
    }
    __syncthreads();
    if (failed) return;
    // this block's range: whole packs of 16 elements (16-byte aligned in the slots)
    const u64 per = ((n + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
    const u64 lo = min_u64(n, b * per), count = min_u64(n, lo + per) - lo;
    const u64 half = GPURING_FUSED_DATA + (epoch & 1) * slot_bytes;
    T* mine = reinterpret_cast<T*>(regions[rank] + half);
    const u64 bytes = count * sizeof(T);
    // (1) stage: what the peers will read of this rank
    const bool by_blocks = kind == GPURING_REDUCE_SCATTER || kind == GPURING_ALL_TO_ALL ||
                           (kind == GPURING_SCATTER && rank == root);
    if (by_blocks) {  // every rank's block of the input (a rank reads its own from `in`)
        for (int q = 0; q < nranks; ++q)
            if (q != rank)
                block_copy(reinterpret_cast<unsigned char*>(mine + q * n + lo),
                           reinterpret_cast<const unsigned char*>(in + q * stride + lo),
                           bytes);
    } else if ((kind != GPURING_BROADCAST && kind != GPURING_SCATTER &&
                kind != GPURING_GATHER) ||
               (kind == GPURING_BROADCAST && rank == root) ||
               (kind == GPURING_GATHER && rank != root)) {
        block_copy(reinterpret_cast<unsigned char*>(mine + lo),
                   reinterpret_cast<const unsigned char*>(in + lo), bytes);
    }
    __syncthreads();
    // (2) tell the peers, hear from them
    const int t = threadIdx.x;
    if (t < nranks && t != rank &&
        !fused_handshake(regions, rank, t, b, epoch, timeout_ns, status, abort))
        failed = 1;
    __syncthreads();
    if (failed) return;
    // (3) this rank's result, from every rank's slot (its own part from `in`)
    if (kind == GPURING_ALL_GATHER || (kind == GPURING_GATHER && rank == root)) {
        for (int q = 0; q < nranks; ++q) {
            const T* from = q == rank ? in : reinterpret_cast<const T*>(regions[q] + half);
            if (from + lo != out + q * stride + lo)  // (an all_gather in place)
                block_copy(reinterpret_cast<unsigned char*>(out + q * stride + lo),
                           reinterpret_cast<const unsigned char*>(from + lo), bytes);
        }
    } else if (kind == GPURING_ALL_TO_ALL) {  // block `rank` of every rank's input
        for (int q = 0; q < nranks; ++q) {
            const T* from = q == rank ? in + (u64)rank * stride
                                      : reinterpret_cast<const T*>(regions[q] + half) +
                                            (u64)rank * n;
            block_copy(reinterpret_cast<unsigned char*>(out + q * stride + lo),
                       reinterpret_cast<const unsigned char*>(from + lo), bytes);
        }
    } else if (kind == GPURING_SCATTER) {  // block `rank` of the root's input
        const T* from = rank == root ? in + (u64)rank * stride
                                     : reinterpret_cast<const T*>(regions[root] + half) +
                                           (u64)rank * n;
        block_copy(reinterpret_cast<unsigned char*>(out + lo),
                   reinterpret_cast<const unsigned char*>(from + lo), bytes);
    } else if (kind == GPURING_GATHER) {  // off the root: nothing
    } else if (kind == GPURING_BROADCAST) {
        const T* from = rank == root ? in : reinterpret_cast<const T*>(regions[root] + half);
        if (from != out)
            block_copy(reinterpret_cast<unsigned char*>(out + lo),
                       reinterpret_cast<const unsigned char*>(from + lo), bytes);
    } else if (kind != GPURING_REDUCE || rank == root) {
        const bool blocks = kind == GPURING_REDUCE_SCATTER;  // this rank's block of each
        const T* sources[GPURING_MAX_SOURCES] = {};
        for (int q = 0; q < nranks; ++q)
            sources[q] = (q == rank ? in + (blocks ? (u64)rank * stride : 0)
                                    : reinterpret_cast<const T*>(regions[q] + half) +
                                          (blocks ? (u64)rank * n : 0)) +
                         lo;
        fold_by<T, Op>(out + lo, sources, nranks, divisor, count, threadIdx.x, blockDim.x);
    }
    // every block has read the epoch by the time the last one is done: that one moves it on
    if (threadIdx.x == 0) {
        unsigned int* done_blocks = reinterpret_cast<unsigned int*>(regions[rank] + 8);
        __threadfence();
        if (atomicAdd(done_blocks, 1u) == gridDim.x - 1) {
            __threadfence();
            *done_blocks = 0;
            *done_calls = epoch;
            __threadfence();
        }
    }
}

#define GPURING_FUSED(NAME, T, OPNAME, OP) \
    extern "C" __global__ void gpuring_fused_##NAME##_##OPNAME( \
        T* out, const T* in, u64 n, u64 stride, long long divisor, int kind, int root, \
        int rank, int nranks, unsigned char* r0, unsigned char* r1, unsigned char* r2, \
        unsigned char* r3, unsigned char* r4, unsigned char* r5, unsigned char* r6, \
        unsigned char* r7, u64 slot_bytes, u64 timeout_ns, volatile int* status, \
        volatile int* abort) { \
        unsigned char* const regions[GPURING_FUSED_MAX_RANKS] = {r0, r1, r2, r3, \
                                                                 r4, r5, r6, r7}; \
        fused_collective<T, OP>(out, in, n, stride, divisor, kind, root, rank, nranks, \
                                regions, slot_bytes, timeout_ns, status, abort); \
    }

#define GPURING_FUSED_REAL(NAME, T) \
    GPURING_FUSED(NAME, T, sum, OpSum) \
    GPURING_FUSED(NAME, T, prod, OpProd) \
    GPURING_FUSED(NAME, T, min, OpMin) \
    GPURING_FUSED(NAME, T, max, OpMax)

#define GPURING_FUSED_COMPLEX(NAME, T) \
    GPURING_FUSED(NAME, T, sum, OpSum) \
    GPURING_FUSED(NAME, T, prod, OpProd)

GPURING_FUSED_REAL(int8, signed char)
GPURING_FUSED_REAL(int16, short)
GPURING_FUSED_REAL(int32, int)
GPURING_FUSED_REAL(int64, long long)
GPURING_FUSED_REAL(uint8, unsigned char)
GPURING_FUSED_REAL(uint16, unsigned short)
GPURING_FUSED_REAL(uint32, unsigned int)
GPURING_FUSED_REAL(uint64, u64)
GPURING_FUSED_REAL(float16, __half)
GPURING_FUSED_REAL(bfloat16, __nv_bfloat16)
GPURING_FUSED_REAL(float32, float)
GPURING_FUSED_REAL(float64, double)
GPURING_FUSED_COMPLEX(complex64, cfloat)
GPURING_FUSED_COMPLEX(complex128, cdouble)

#undef GPURING_FUSED_COMPLEX
#undef GPURING_FUSED_REAL
#undef GPURING_FUSED

// ---------------------------------------------------------------------------------------
// The stream-memory-operation form of the one-operation all_reduce (for ranks that share a
// GPU, where a spinning kernel would hold the GPU for its turn): this kernel stages the
// rank's input in its slot and then tells the peers, the stream waits for theirs
// (cuStreamBatchMemOp), and gpuring_reduce_n folds every rank's slot in rank order.
//
//   gpuring_stage_publish(dst, src, nbytes, f0, ..., f7, count, value, done, abort)
//
// copies nbytes from src to dst (any grid), and once every block has (the last one to finish,
// counted in *done, which it sets back to 0) sets the first `count` flags to `value` (values
// only grow), after a system-scope fence: a peer that sees a flag sees the data. Nothing is
// published once *abort is set.
extern "C" __global__ void gpuring_stage_publish(unsigned char* dst, const unsigned char* src,
                                                 u64 nbytes, volatile u64* f0, volatile u64* f1,
                                                 volatile u64* f2, volatile u64* f3,
                                                 volatile u64* f4, volatile u64* f5,
                                                 volatile u64* f6, volatile u64* f7, int count,
                                                 u64 value, unsigned int* done,
                                                 const volatile int* abort) {
    __shared__ int skip;
    if (threadIdx.x == 0) skip = *abort != 0;
    __syncthreads();
    if (skip) return;
    elementwise<unsigned char>(BinaryBody<unsigned char, TakeFirst>(dst, src, src, TakeFirst()),
                               nbytes);
    __syncthreads();  // the block's copies before its thread 0 counts the block done
    if (threadIdx.x != 0) return;
    __threadfence();
    if (atomicAdd(done, 1u) != gridDim.x - 1) return;
    __threadfence();
    *done = 0;
    if (*abort) return;
    volatile u64* flags[GPURING_MAX_FLAGS] = {f0, f1, f2, f3, f4, f5, f6, f7};
    __threadfence_system();  // every block's copy (each fenced before it counted) first
    for (int i = 0; i < count && i < GPURING_MAX_FLAGS; ++i) {
        if (*flags[i] < value) *flags[i] = value;
    }
    __threadfence_system();
}
