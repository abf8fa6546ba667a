/* A decode step's decoder layers in one foreign call: each layer's kernels called in the order the Python forward
 * calls them (common/engine/decode_forward.py), from C.
 *
 * Why: the kernels of a layer (the fused q|k|v GEMM, the rotation + KV write + attention, the o projection, the add +
 * norm, the gated gate|up GEMM, the down projection, the add + norm) are seven foreign calls, each with its checks,
 * its output tensor and its ctypes crossing made in Python: about 1.8 ms of a batch-32 step of prism-small-llava
 * (8 layers) was Python between the kernels, and while the main thread ran it the other OpenMP thread spun, slowing
 * the one core left to it. Here the same kernels run back to back, with no Python between them.
 *
 * Exactness: nothing is computed here. Each kernel is the very entry point of its own library (common/model/row_gemm.c,
 * common/kv/native/paged_decode_attention.c, common/kv/native/rms_norm.c), called with the inputs and thread count
 * the Python path gives it, its address passed in by the caller: the outputs are the Python path's bit for bit
 * (tested). Each kernel still opens its own OpenMP region on PyTorch's pool (the same libgomp).
 *
 * Buffers are the caller's (chain_t: one set per step, reused by every layer). The residual stream h is updated in
 * place (rms_norm's sum may be its input: each element is read before it is written), x ends as the final norm's output.
 * The step's two ends run here too: the token embeddings (rows of the table, copied) with the first layer's input
 * norm, and, where the caller gives its panels, the LM head's GEMM after the final norm.
 *
 * Returns 0, or layer * KERNELS + kernel + 1 for the first kernel that refused or failed, EMBEDDING or HEAD for the
 * ends (the caller then runs the whole step its own way: every KV row written here is written again with the same
 * bits). Each kernel's time is summed into chain_t.ns (a benchmark's split of the step).
 */
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef int (*gemm_fn)(const float *x, const float *packed, const float *bias, float *out, int64_t M, int64_t N,
                       int64_t K, int threads);
typedef int (*gated_fn)(const float *x, const float *packed, const float *bias, float *out, int64_t M, int64_t N,
                        int64_t K, int threads, void *sleef_exp);
typedef int (*rope_fn)(const float *qkv, const float *cos, const float *sin, float *q, float *k, float *v, float *out,
                       const int64_t *tables, int64_t table_width, const int64_t *lengths, int64_t batch,
                       int64_t q_heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int threads);
typedef int (*norm_fn)(const float *h, const float *add, float *sum, const float *weight, float *out, int64_t rows,
                       int64_t n, float eps, int64_t lanes, int threads);

/* One decoder layer's weights (row-kernel panels, biases or NULL, norm weights: the next layer's input norm, or the
 * final norm after the last) and the index of its layer in the KV pool. */
typedef struct {
    const float *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias, *down, *down_bias, *next_norm;
    int64_t index;
    float post_eps, next_eps;
} layer_t;

/* A layer's kernels, in the order they run (chain_t.ns). */
enum { QKV, ATTENTION, O_PROJ, ATTENTION_NORM, GATE_UP, DOWN, MLP_NORM, KERNELS };

/* The kernels, the model's sizes, this step's inputs and the scratch buffers every layer reuses. */
typedef struct {
    gemm_fn gemm;
    gated_fn gated;
    void *sleef_exp;
    rope_fn rope;
    norm_fn norm;
    int64_t rows, hidden, inter, q_heads, kv_heads, dim, block_size, table_width, lanes;
    float scale;
    int threads;
    const float *cos, *sin;
    const int64_t *tables, *lengths;
    float *keys, *values; /* the pool's stores [layers, blocks, block_size, kv_heads, dim]: layer i at i * layer_size */
    int64_t layer_size;
    float *h, *x;                           /* [rows, hidden]: the residual stream, its normed copy */
    float *qkv, *query, *attn, *proj, *act; /* a layer's intermediates */
    int64_t *ns; /* [KERNELS]: the time spent in each kernel of a layer (KERNELS' order), added to over the layers */
    /* The step's two ends. embedding: the table whose rows ids[r] (each below table_rows) become h, then the first
     * layer's input norm of h becomes x. head: the LM head's panels, its logits [rows, vocab] from the final x (NULL:
     * none, the caller's). */
    const float *embedding, *first_norm;
    const int64_t *ids;
    int64_t table_rows;
    float first_eps;
    const float *head, *head_bias;
    int64_t vocab;
    float *logits;
} chain_t;

/* decode_layers' refusals outside the layers (a layer's: layer * KERNELS + kernel + 1) */
enum { EMBEDDING = -1, HEAD = -2 };

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* The embedding rows and the first input norm, then the layers, from x = the first layer's input norm of h to x = the
 * final norm of h, then the LM head (where given). */
int decode_layers(chain_t *c, const layer_t *layers, int64_t count) {
    const int64_t B = c->rows, H = c->hidden, QD = c->q_heads * c->dim, qkv_n = (c->q_heads + 2 * c->kv_heads) * c->dim;
    for (int64_t r = 0; r < B; r++) {
        if (c->ids[r] < 0 || c->ids[r] >= c->table_rows) return EMBEDDING; /* (F.embedding raises, in Python) */
        memcpy(c->h + r * H, c->embedding + c->ids[r] * H, H * sizeof(float));
    }
    if (c->norm(c->h, 0, 0, c->first_norm, c->x, B, H, c->first_eps, c->lanes, c->threads)) return EMBEDDING;
    for (int64_t l = 0; l < count; l++) {
        const layer_t *L = layers + l;
        float *keys = c->keys + L->index * c->layer_size, *values = c->values + L->index * c->layer_size;
        int64_t t = now_ns();
        int status = 0;
        /* each kernel timed to the one after it (one clock read between two kernels) */
#define RUN(KERNEL, CALL)                         \
    if (!status) status = (CALL) ? KERNEL + 1 : 0; \
    {                                              \
        const int64_t end = now_ns();              \
        c->ns[KERNEL] += end - t;                  \
        t = end;                                   \
    }
        RUN(QKV, c->gemm(c->x, L->qkv, L->qkv_bias, c->qkv, B, qkv_n, H, c->threads))
        RUN(ATTENTION, c->rope(c->qkv, c->cos, c->sin, c->query, keys, values, c->attn, c->tables, c->table_width,
                               c->lengths, B, c->q_heads, c->kv_heads, c->dim, c->block_size, c->scale, c->threads))
        RUN(O_PROJ, c->gemm(c->attn, L->o, L->o_bias, c->proj, B, H, QD, c->threads))
        RUN(ATTENTION_NORM, c->norm(c->h, c->proj, c->h, L->post_norm, c->x, B, H, L->post_eps, c->lanes, c->threads))
        RUN(GATE_UP, c->gated(c->x, L->gate_up, L->gate_up_bias, c->act, B, 2 * c->inter, H, c->threads, c->sleef_exp))
        RUN(DOWN, c->gemm(c->act, L->down, L->down_bias, c->proj, B, H, c->inter, c->threads))
        RUN(MLP_NORM, c->norm(c->h, c->proj, c->h, L->next_norm, c->x, B, H, L->next_eps, c->lanes, c->threads))
#undef RUN
        if (status) return (int)(l * KERNELS + status);
    }
    if (c->head && c->gemm(c->x, c->head, c->head_bias, c->logits, B, c->vocab, H, c->threads)) return HEAD;
    return 0;
}
