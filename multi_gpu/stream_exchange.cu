// The GPU-ordered exchange of dual_mlp.py (--sync gpu): one kernel, on each
// GPU's own stream, at the end of the compiled training step.  The protocol,
// and why it cannot deadlock or overwrite what a peer still reads, is told in
// stream_exchange.py, which compiles this file with PyCUDA.
//
// The sizes come from there as -D options, the same on every GPU:
// MAX_WORKERS, MAX_SEGMENTS (the most parameters), GRID and BLOCK (block b of
// every GPU handles the same elements).
#include <cstddef>

#if !defined(MAX_WORKERS) || !defined(MAX_SEGMENTS) || !defined(GRID) || !defined(BLOCK)
#error "compile with stream_exchange.kernel_options(): -DMAX_WORKERS=.. -DMAX_SEGMENTS=.. -DGRID=.. -DBLOCK=.."
#endif

// One worker's counters, in its GPU's memory; the other workers write
// published, over NVLink, block by block.
struct Flags {
    int step[GRID];                          // the steps block b has begun here
    int published[GRID][MAX_WORKERS];        // [b][w]: the last step worker w's block b published
};

// Every worker's buffers, as this GPU addresses them (its own included):
// passed by value, and indexed only by numbers the compiler knows (pick),
// so that they stay in the kernel's parameters, not in local memory.
struct Peers {
    float *send[MAX_WORKERS];
    Flags *flags[MAX_WORKERS];
};

// The weights the step trains, as XLA holds them: one buffer per parameter,
// in the layout's order, and each one's gradient (null: none, no update).
// Each is cut into chunks of ``width`` floats (4, or 1 where the segment
// does not start on 16 bytes of the flat layout; its last chunk may be
// short), numbered across the segments: thread q of the grid moves chunks
// q, q + GRID * BLOCK, ...  Passed by value.
struct Segments {
    float *data[MAX_SEGMENTS];
    const float *gradient[MAX_SEGMENTS];
    long long start[MAX_SEGMENTS];           // where it begins in the flat layout (send slots)
    long long length[MAX_SEGMENTS];
    int width[MAX_SEGMENTS];
    long long chunks_end[MAX_SEGMENTS];      // chunks in this segment and all before it
    int count;
};

// Up to four consecutive floats of one parameter: what a thread moves at once.
struct Chunk {
    float *weights;                          // in XLA's buffer
    const float *gradient;                   // the same floats' gradient, or null
    long long flat;                          // the same floats' index in a send slot
    int count;
};

__device__ Flags flags_size;  // never used: its size, read at load, sizes the allocation

// --trace: block 0's clock at each phase of one step, in host memory (a
// ring the host reads as the calls end).  ``step`` is written last, after
// a fence, so that a host that reads it sees the rest.
struct Stamp {
    unsigned long long begin, published;     // %globaltimer, ns
    unsigned long long signalled;            // its own flag stored (a fenced store) and seen
    unsigned long long seen, written;        // every worker's flag seen; the mean written
    int last;                                // the worker whose flag block 0 saw last
    int step;
};

// How the structs the host mirrors are laid out here, read at load and
// compared with the mirrors (stream_exchange.mirror_layouts): each struct's
// size, then each field's offset, in the order they are declared.
__device__ unsigned long long layouts[] = {
    sizeof(Peers), offsetof(Peers, send), offsetof(Peers, flags),
    sizeof(Segments), offsetof(Segments, data), offsetof(Segments, gradient),
    offsetof(Segments, start), offsetof(Segments, length), offsetof(Segments, width),
    offsetof(Segments, chunks_end), offsetof(Segments, count),
    sizeof(Stamp), offsetof(Stamp, begin), offsetof(Stamp, published),
    offsetof(Stamp, signalled), offsetof(Stamp, seen), offsetof(Stamp, written),
    offsetof(Stamp, last), offsetof(Stamp, step),
};

// The GPU's own clock: nanoseconds, the same for every block of a GPU.
__device__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
    return t;
}

// from[w] for a w known only at run time, by selects: indexing the array
// itself would copy it into local memory.  For ``rank`` the compiler folds
// the selects back into an index, so the kernel takes peers.flags[rank] and
// peers.send[rank] as arguments of their own.
template <typename T> __device__ T pick(T const (&from)[MAX_WORKERS], int w) {
    T p = from[0];
#pragma unroll
    for (int k = 1; k < MAX_WORKERS; ++k) if (k == w) p = from[k];
    return p;
}

// An acquire load at system scope: what the GPU that stored the value wrote
// before its release is visible to this thread's later reads.
__device__ int load_acquire(const int *p) {
    int v;
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// A release store at system scope: what this block wrote before the
// __syncthreads() that precedes it is visible to any GPU that sees the value.
// Its fence waits until the block's stores have reached every GPU: ~1 us.
__device__ void store_release(int *p, int v) {
    asm volatile("st.release.sys.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// Thread w < N waits until worker w's counter here reaches t: a spin on this
// GPU's own memory, ~1 us once the other's store has crossed NVLink.
__device__ void wait_for(const int *counter, int t) {
    while (load_acquire(counter) < t) __nanosleep(32);
}

// Chunk q: a thread's q only grows, so its segment s only moves on.
__device__ Chunk chunk(const Segments &w, int &s, long long q) {
    while (q >= w.chunks_end[s]) ++s;
    const long long offset = (q - (s ? w.chunks_end[s - 1] : 0)) * w.width[s];
    return {w.data[s] + offset, w.gradient[s] ? w.gradient[s] + offset : nullptr,
            w.start[s] + offset,
            (int)min((long long)w.width[s], w.length[s] - offset)};
}

// A chunk in one 16-byte access where it can be, float by float where it
// cannot (a short chunk, or an XLA buffer not on 16 bytes).
__device__ bool whole(const float *p, int count) {
    return count == 4 && ((unsigned long long)p & 15) == 0;
}

__device__ float4 load(const float *p, int count) {
    if (whole(p, count)) return *(const float4 *)p;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k = 0; k < 4; ++k) if (k < count) v[k] = p[k];
    return make_float4(v[0], v[1], v[2], v[3]);
}

__device__ void store(float *p, float4 v, int count) {
    if (whole(p, count)) { *(float4 *)p = v; return; }
    const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) if (k < count) p[k] = f[k];
}

__device__ float4 operator+(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

__device__ float4 operator/(float4 a, float n) {
    return make_float4(a.x / n, a.y / n, a.z / n, a.w / n);
}

// The tutorial's SGD update, w - rate * g, rounded as PyTensor's graph
// rounds it: a product, then a difference (no fused multiply-add).
__device__ float4 updated(float4 w, float4 g, float rate) {
    return make_float4(__fsub_rn(w.x, __fmul_rn(rate, g.x)), __fsub_rn(w.y, __fmul_rn(rate, g.y)),
                       __fsub_rn(w.z, __fmul_rn(rate, g.z)), __fsub_rn(w.w, __fmul_rn(rate, g.w)));
}

// What a worker publishes of a chunk: its weights after this step's update.
__device__ float4 published_chunk(const Chunk &c, float rate) {
    const float4 w = load(c.weights, c.count);
    return c.gradient ? updated(w, load(c.gradient, c.count), rate) : w;
}

// Block 0's stamps of step t, into its slot of the ring: the last worker
// is the one whose flag it saw last.
__device__ void stamp(Stamp *ring, int slots, int t, int rank, int n_workers,
                      unsigned long long began, unsigned long long published,
                      const unsigned long long *seen_at) {
    int last = 0;
    for (int w = 1; w < n_workers; ++w) if (seen_at[w] > seen_at[last]) last = w;
    Stamp *s = ring + t % slots;
    s->begin = began, s->published = published, s->signalled = seen_at[rank];
    s->seen = seen_at[last];
    s->written = globaltimer(), s->last = last;
    __threadfence_system();
    *(volatile int *)&s->step = t;
}

extern "C" __global__ void __launch_bounds__(BLOCK)
exchange(const Peers peers, int rank, int n_workers, Flags *mine, float *own,
         const Segments weights, float rate, long long slot_floats, volatile unsigned *done,
         Stamp *stamps, int slots) {
    // mine, own: peers.flags[rank] and peers.send[rank], passed apart (see pick);
    // stamps: null, or --trace's ring of ``slots`` steps
    const int b = blockIdx.x, me = threadIdx.x;  // threads me < N: one each for worker me
    const bool stamping = stamps && b == 0;
    __shared__ unsigned long long seen_at[MAX_WORKERS];
    const unsigned long long began = stamping ? globaltimer() : 0;
    const long long chunks = weights.chunks_end[weights.count - 1],
                    first = b * (long long)BLOCK + me, stride = (long long)GRID * BLOCK;
    const int t = mine->step[b] + 1;                              // begin: every thread loads
    const long long slot = (t & 1) * slot_floats;                 // t and its first chunk at
    float *published = own + slot;                                // once (t is needed only to
    int s = 0;                                                    // store the chunk)
    for (long long q = first; q < chunks; q += stride) {          // publish
        const Chunk c = chunk(weights, s, q);
        store(published + c.flat, published_chunk(c, rate), c.count);
    }
    __syncthreads();                                              // every thread has read t
    const unsigned long long published_at = stamping ? globaltimer() : 0;
    if (me == 0) mine->step[b] = t;
    if (me < n_workers) {                                         // signal: "published t",
        store_release(&pick(peers.flags, me)->published[b][rank], t); // a 4-byte NVLink store
        wait_for(&mine->published[b][me], t);                     // and worker me's to us
        if (stamping) seen_at[me] = globaltimer();
    }
    __syncthreads();
    s = 0;
    for (long long q = first; q < chunks; q += stride) {          // reduce, in rank order
        const Chunk c = chunk(weights, s, q);
        float4 sum = load(peers.send[0] + slot + c.flat, c.count);
#pragma unroll
        for (int w = 1; w < MAX_WORKERS; ++w)                     // N - 1 loads in flight at once
            if (w < n_workers) sum = sum + load(peers.send[w] + slot + c.flat, c.count);
        store(c.weights, sum / (float)n_workers, c.count);
    }
    __syncthreads();                                              // end: the block's reads are
    if (me == 0) done[b] = t;                                     // done; host memory, PCIe
    if (stamping && me == 0) stamp(stamps, slots, t, rank, n_workers, began, published_at, seen_at);
}

// --trace: the GPU's clock beside the host's.  For k = 1 .. samples the host
// writes k into *asked, and this one thread answers with the clock in
// answer[k] as soon as it sees it; then answer[0] = the clock's tick, the
// least step it was seen to take.
extern "C" __global__ void read_clock(const volatile int *asked,
                                      volatile unsigned long long *answer, int samples) {
    for (int k = 1; k <= samples; ++k) {
        while (*asked < k) {}
        answer[k] = globaltimer();
        __threadfence_system();
    }
    unsigned long long before = globaltimer(), tick = ~0ull;
    for (int seen = 0, tries = 0; seen < 16 && tries < 1000000; ++tries) {
        const unsigned long long now = globaltimer();
        if (now != before) tick = min(tick, now - before), before = now, ++seen;
    }
    answer[0] = tick;
}
