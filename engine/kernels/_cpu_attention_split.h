/* Work units, split-K and scratch of engine/kernels/_cpu_attention.c's attention().
 * Included once, by that file only, after _cpu_attention_loops.h.
 *
 * Split-K (flash-decoding): one sequence in decode is 3 items (its KV heads) for 2 threads, and
 * a long context leaves one thread idle for a third of the call. So an item's pool blocks are
 * split into parts, each a unit of work with its own softmax state (max, sum, unnormalized acc);
 * the parts are then merged in order 0, 1, .. (the step's own rows go with the last part):
 *
 *     item (seq, kv head):  blocks [0, b1) | [b1, b2) | .. | [bP-1, end) + own rows
 *     merge:                m = max_p m_p;  acc = sum_p e^(m_p - m) acc_p;  sum likewise
 *
 * How many parts depends on the item's own context length alone: never on the thread count, nor
 * on the other sequences of the call (the fused decoder and the Python layers batch sequences
 * differently and must agree bit for bit). Parts of at least SPLIT_PART_BLOCKS blocks keep the
 * merge and the per-unit costs small beside the keys a part reads.
 *
 * Scratch: every thread keeps its buffers (thread-local, grown when a call needs more), so a
 * call makes no malloc; libgomp's threads live as long as the process, and so do the buffers. */

#ifndef SPLITSERVE_CPU_ATTENTION_SPLIT_H
#define SPLITSERVE_CPU_ATTENTION_SPLIT_H

#include <stdlib.h>

#include "_cpu_attention_loops.h"

#define SPLIT_PART_BLOCKS 6 /* pool blocks per part at least (96 keys of 16-key blocks) */
#define SPLIT_MAX_PARTS 6

/* A buffer of at least `bytes`, 64-byte aligned, kept in *buffer between calls; NULL if the
 * memory cannot be had. */
static void *grown(void **buffer, size_t *capacity, size_t bytes) {
    if (bytes <= *capacity) {
        return *buffer;
    }
    free(*buffer);
    size_t rounded = (bytes + 4095) & ~(size_t)4095;
    *buffer = aligned_alloc(64, rounded);
    *capacity = *buffer != NULL ? rounded : 0;
    return *buffer;
}

static __thread void *thread_scratch;
static __thread size_t thread_scratch_bytes;
static __thread void *thread_units;
static __thread size_t thread_units_bytes;

static Py_ssize_t round16(Py_ssize_t floats) {
    return (floats + 15) & ~(Py_ssize_t)15;
}

/* This thread's Scratch for items of up to `rows` rows; 0, or -1 when memory ran out. Every
 * array starts on a 64-byte boundary (the AVX-512 loops load k_tile and probs aligned). */
static int thread_scratch_for(Scratch *w, Py_ssize_t rows, int hd, int block_size) {
    Py_ssize_t keys = block_size > 16 ? block_size : 16;
    Py_ssize_t sizes[8] = {rows * hd, rows * hd, rows, rows, keys, keys * hd, keys * hd, rows * 16};
    Py_ssize_t total = 0;
    for (int i = 0; i < 8; i++) {
        total += round16(sizes[i]);
    }
    float *base = grown(&thread_scratch, &thread_scratch_bytes, sizeof(float) * total);
    if (base == NULL) {
        return -1;
    }
    float **slots[8] = {&w->q, &w->acc, &w->max, &w->sum, &w->weights, &w->k_tile, &w->v_tile, &w->probs};
    for (int i = 0; i < 8; i++) {
        *slots[i] = base;
        base += round16(sizes[i]);
    }
    return 0;
}

static int64_t pool_blocks_of(const AttentionArgs *a, Py_ssize_t seq) {
    return (a->starts[seq] + a->pool.block_size - 1) / a->pool.block_size;
}

static int64_t parts_of(const AttentionArgs *a, Py_ssize_t seq) {
    int64_t parts = pool_blocks_of(a, seq) / SPLIT_PART_BLOCKS;
    parts = parts < SPLIT_MAX_PARTS ? parts : SPLIT_MAX_PARTS;
    return parts > 1 ? parts : 1;
}

typedef struct {
    WorkUnit *units;
    Py_ssize_t num_units;
    Py_ssize_t max_rows;
} UnitPlan;

/* The call's units, item by item, each item's parts in order; partial states after the units in
 * the calling thread's buffer. 0, or -1 when memory ran out. */
static int plan_units(const AttentionArgs *a, Py_ssize_t num_seqs, UnitPlan *plan) {
    int kv_heads = a->pool.num_kv_heads, hd = a->pool.head_dim;
    Py_ssize_t num_units = 0, partial_floats = 0;
    plan->max_rows = 0;
    for (Py_ssize_t s = 0; s < num_seqs; s++) {
        Py_ssize_t rows = (a->query_starts[s + 1] - a->query_starts[s]) * a->group;
        int64_t parts = parts_of(a, s);
        plan->max_rows = rows > plan->max_rows ? rows : plan->max_rows;
        num_units += parts * kv_heads;
        partial_floats += parts > 1 ? parts * kv_heads * rows * (hd + 2) : 0;
    }
    size_t unit_bytes = (sizeof(WorkUnit) * num_units + 63) & ~(size_t)63;
    char *buffer = grown(&thread_units, &thread_units_bytes, unit_bytes + sizeof(float) * partial_floats);
    if (buffer == NULL) {
        return -1;
    }
    plan->units = (WorkUnit *)buffer;
    plan->num_units = num_units;
    float *partial = (float *)(buffer + unit_bytes);
    WorkUnit *u = plan->units;
    for (Py_ssize_t s = 0; s < num_seqs; s++) {
        Py_ssize_t rows = (a->query_starts[s + 1] - a->query_starts[s]) * a->group;
        int64_t parts = parts_of(a, s), blocks = pool_blocks_of(a, s);
        for (int h = 0; h < kv_heads; h++) {
            for (int64_t p = 0; p < parts; p++, u++) {
                *u = (WorkUnit){s, h, p == parts - 1, blocks * p / parts, blocks * (p + 1) / parts, NULL, (int)p, (int)parts};
                if (parts > 1) {
                    u->partial = partial;
                    partial += rows * (hd + 2);
                }
            }
        }
    }
    return 0;
}

/* Part 0 of a split item: all its parts' states (consecutive after it) merged in order and
 * normalized into `out`, through the thread's scratch. */
static void merge_parts(const AttentionArgs *a, Scratch *w, const WorkUnit *first) {
    int hd = a->pool.head_dim;
    int rows = (int)(a->query_starts[first->seq + 1] - a->query_starts[first->seq]) * a->group;
    for (int r = 0; r < rows; r++) {
        float m = -INFINITY;
        for (int p = 0; p < first->num_parts; p++) {
            float part_max = first[p].partial[(Py_ssize_t)r * (hd + 2) + hd];
            m = part_max > m ? part_max : m;
        }
        float *acc = w->acc + (Py_ssize_t)r * hd, sum = 0.0f;
        memset(acc, 0, sizeof(float) * hd);
        for (int p = 0; p < first->num_parts; p++) {
            const float *state = first[p].partial + (Py_ssize_t)r * (hd + 2);
            float factor = expf(state[hd] - m);
            sum += factor * state[hd + 1];
            for (int d = 0; d < hd; d++) {
                acc[d] += factor * state[d];
            }
        }
        w->sum[r] = sum;
    }
    WorkUnit whole = *first;
    whole.partial = NULL;
    store_rows(a, w, &whole, rows, hd);
}

#endif
