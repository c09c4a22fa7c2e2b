// Host emulation of the CUDA built-ins that kernels/reduce.cu uses, so that its kernels
// compile with a host C++ compiler and run on the CPU in tests (see test_kernels_on_host.py).
// A launch of a kernel without barriers runs every (block, thread) of the grid in turn on the
// calling thread: they do not communicate, so this computes what the GPU computes. A kernel
// with `__syncthreads` (the one-kernel all_reduce) runs its blocks in turn, and the threads
// of a block as coroutines: each runs until it reaches the barrier or returns, and none goes
// past a barrier before every thread of its block has reached it or returned, as on the GPU
// (sm_70 and later: threads that returned no longer count). `__shared__` variables are
// shared by the threads of the running block (every block starts them anew, as it sets
// them first). Compile with -ffp-contract=off: the device code relies on no FMA contraction
// too.
#pragma once
#include <vector_types.h>  // uint3, dim3 (and the CUDA host defines)

#include <ucontext.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

#undef __global__
#undef __device__
#undef __forceinline__
#undef __shared__
#undef __noinline__
#define __noinline__ __attribute__((noinline))
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static thread_local

static thread_local uint3 threadIdx, blockIdx;
static thread_local dim3 blockDim, gridDim;

inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline double __dadd_rn(double a, double b) { return a + b; }

inline void __nanosleep(unsigned int ns) {
    std::this_thread::sleep_for(std::chrono::nanoseconds(ns));
}
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
    return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}
inline unsigned long long gpuring_host_globaltimer() {
    return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// Blocks whose threads run as coroutines (EMU_BLOCK_THREADS): the running block's threads,
// their contexts and stacks (kept for the next launch on this host thread).
struct EmuBlock {
    ucontext_t scheduler;
    std::vector<ucontext_t> threads;
    std::vector<char> stacks;
    std::vector<char> returned;
    const std::function<void()>* body = nullptr;
    unsigned running = 0;
};
static const size_t EMU_STACK_BYTES = 64 << 10;
static thread_local EmuBlock* emu_block = nullptr;

// A barrier: back to the block's scheduler, which resumes this thread once every thread of
// the block has reached a barrier or returned.
inline void __syncthreads() {
    EmuBlock* block = emu_block;
    if (block == nullptr) std::abort();  // a barrier in a kernel launched without coroutines
    swapcontext(&block->threads[block->running], &block->scheduler);
}

static void emu_thread_entry() {
    EmuBlock* block = emu_block;
    (*block->body)();
    block->returned[block->running] = 1;  // then back to the scheduler (uc_link)
}

// Run `grid` blocks of `threads` coroutines each, every one calling `body`.
inline void emu_run_blocks(unsigned grid, unsigned threads, const std::function<void()>& body) {
    static thread_local EmuBlock block;
    block.threads.resize(threads);
    block.stacks.resize(threads * EMU_STACK_BYTES);
    block.body = &body;
    emu_block = &block;
    gridDim = dim3(grid);
    blockDim = dim3(threads);
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx.x = b;
        blockIdx.y = blockIdx.z = 0;
        block.returned.assign(threads, 0);
        for (unsigned t = 0; t < threads; ++t) {
            ucontext_t& context = block.threads[t];
            getcontext(&context);
            context.uc_stack.ss_sp = &block.stacks[t * EMU_STACK_BYTES];
            context.uc_stack.ss_size = EMU_STACK_BYTES;
            context.uc_link = &block.scheduler;
            makecontext(&context, emu_thread_entry, 0);
        }
        for (bool waiting = true; waiting;) {  // one pass: every thread to its next barrier
            waiting = false;
            for (unsigned t = 0; t < threads; ++t) {
                if (block.returned[t]) continue;
                block.running = t;
                threadIdx.x = t;
                threadIdx.y = threadIdx.z = 0;
                swapcontext(&block.scheduler, &block.threads[t]);
                waiting = waiting || !block.returned[t];
            }
        }
    }
    emu_block = nullptr;
}

// The vector width the element-wise driver chose in the calling thread's last launch (0:
// scalar, -1: none chosen), so that tests can check which path a placement takes.
static thread_local int emu_vector_width = -1;
#define GPURING_VECTOR_WIDTH(W) (emu_vector_width = (W))
extern "C" int emu_last_vector_width() { return emu_vector_width; }

// Launchers: the kernel is passed by address, with the parameters of its family.
typedef unsigned long long emu_u64;
typedef void (*emu_reduce_fn)(void*, const void*, const void*, emu_u64, long long,
                              const volatile int*);
typedef void (*emu_reduce_n_fn)(void*, const void*, const void*, const void*, const void*,
                                const void*, const void*, const void*, const void*, int,
                                emu_u64, long long, const volatile int*);
typedef void (*emu_copy_fn)(void*, const void*, emu_u64, const volatile int*);
typedef void (*emu_wait_fn)(volatile emu_u64*, emu_u64, emu_u64, volatile int*, volatile int*);
typedef void (*emu_write_fn)(volatile emu_u64*, emu_u64, const volatile int*);
typedef void (*emu_write_many_fn)(volatile emu_u64*, volatile emu_u64*, volatile emu_u64*,
                                  volatile emu_u64*, volatile emu_u64*, volatile emu_u64*,
                                  volatile emu_u64*, volatile emu_u64*, int, emu_u64,
                                  const volatile int*);

#define EMU_GRID(grid, block, CALL)                    \
    do {                                               \
        gridDim = dim3(grid);                          \
        emu_vector_width = -1;                         \
        blockDim = dim3(block);                        \
        for (unsigned b_ = 0; b_ < (grid); ++b_) {     \
            for (unsigned t_ = 0; t_ < (block); ++t_) { \
                blockIdx.x = b_;                       \
                blockIdx.y = blockIdx.z = 0;           \
                threadIdx.x = t_;                      \
                threadIdx.y = threadIdx.z = 0;         \
                CALL;                                  \
            }                                          \
        }                                              \
    } while (0)

extern "C" void emu_launch_reduce(void* kernel, unsigned grid, unsigned block, void* dst,
                                  const void* a, const void* b, emu_u64 n, long long divisor,
                                  const void* abort) {
    EMU_GRID(grid, block,
             ((emu_reduce_fn)kernel)(dst, a, b, n, divisor, (const volatile int*)abort));
}

extern "C" void emu_launch_reduce_n(void* kernel, unsigned grid, unsigned block, void* dst,
                                    const void* s0, const void* s1, const void* s2,
                                    const void* s3, const void* s4, const void* s5,
                                    const void* s6, const void* s7, int nsrc, emu_u64 n,
                                    long long divisor, const void* abort) {
    EMU_GRID(grid, block,
             ((emu_reduce_n_fn)kernel)(dst, s0, s1, s2, s3, s4, s5, s6, s7, nsrc, n, divisor,
                                       (const volatile int*)abort));
}

extern "C" void emu_launch_copy(void* kernel, unsigned grid, unsigned block, void* dst,
                                const void* src, emu_u64 nbytes, const void* abort) {
    EMU_GRID(grid, block, ((emu_copy_fn)kernel)(dst, src, nbytes, (const volatile int*)abort));
}

extern "C" void emu_launch_wait(void* kernel, unsigned grid, unsigned block, void* flag,
                                emu_u64 value, emu_u64 timeout_ns, void* status, void* abort) {
    EMU_GRID(grid, block,
             ((emu_wait_fn)kernel)((volatile emu_u64*)flag, value, timeout_ns,
                                   (volatile int*)status, (volatile int*)abort));
}

extern "C" void emu_launch_write(void* kernel, unsigned grid, unsigned block, void* flag,
                                 emu_u64 value, const void* abort) {
    EMU_GRID(grid, block,
             ((emu_write_fn)kernel)((volatile emu_u64*)flag, value, (const volatile int*)abort));
}

extern "C" void emu_launch_write_many(void* kernel, unsigned grid, unsigned block, void* f0,
                                      void* f1, void* f2, void* f3, void* f4, void* f5,
                                      void* f6, void* f7, int count, emu_u64 value,
                                      const void* abort) {
    typedef volatile emu_u64* P;
    EMU_GRID(grid, block,
             ((emu_write_many_fn)kernel)((P)f0, (P)f1, (P)f2, (P)f3, (P)f4, (P)f5, (P)f6,
                                         (P)f7, count, value, (const volatile int*)abort));
}

typedef void (*emu_fused_fn)(void*, const void*, emu_u64, emu_u64, long long, int, int, int,
                              int, void*, void*, void*, void*, void*, void*, void*, void*,
                              emu_u64, emu_u64, volatile int*, volatile int*);

extern "C" void emu_launch_fused(void* kernel, unsigned grid, unsigned block, void* out,
                                  const void* in, emu_u64 n, emu_u64 stride,
                                  long long divisor, int kind, int root, int rank, int nranks,
                                  void* r0, void* r1, void* r2, void* r3, void* r4, void* r5,
                                  void* r6, void* r7, emu_u64 slot_bytes, emu_u64 timeout_ns,
                                  void* status, void* abort) {
    emu_vector_width = -1;
    const std::function<void()> body = [&] {
        ((emu_fused_fn)kernel)(out, in, n, stride, divisor, kind, root, rank, nranks, r0, r1,
                                r2, r3, r4, r5, r6, r7, slot_bytes, timeout_ns,
                                (volatile int*)status, (volatile int*)abort);
    };
    emu_run_blocks(grid, block, body);
}

typedef void (*emu_stage_fn)(void*, const void*, emu_u64, volatile emu_u64*, volatile emu_u64*,
                             volatile emu_u64*, volatile emu_u64*, volatile emu_u64*,
                             volatile emu_u64*, volatile emu_u64*, volatile emu_u64*, int,
                             emu_u64, unsigned int*, const volatile int*);

extern "C" void emu_launch_stage(void* kernel, unsigned grid, unsigned block, void* dst,
                                 const void* src, emu_u64 nbytes, void* f0, void* f1, void* f2,
                                 void* f3, void* f4, void* f5, void* f6, void* f7, int count,
                                 emu_u64 value, void* done, const void* abort) {
    typedef volatile emu_u64* P;
    emu_vector_width = -1;
    const std::function<void()> body = [&] {
        ((emu_stage_fn)kernel)(dst, src, nbytes, (P)f0, (P)f1, (P)f2, (P)f3, (P)f4, (P)f5,
                               (P)f6, (P)f7, count, value, (unsigned int*)done,
                               (const volatile int*)abort);
    };
    emu_run_blocks(grid, block, body);
}
