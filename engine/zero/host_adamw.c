/* AdamW on int8 block-wise moments (engine/state/quantize.py) and a bf16 or fp32 master, on the
 * host: the arithmetic of engine/zero/compact_update.py's compact_adamw_, one block of 256 values
 * at a time, so that each block's new moments are computed once and held in L1 for their
 * maximum and their codes. (Inductor's code for the same function computes them three times, and
 * moves bytes it bit-casts through scalar loops: 3-4x slower on an AVX-512 Xeon.)
 *
 * Built by engine/runtime/native.py with -ffp-contract=off (no fused multiply-add: each product
 * and sum rounds as torch's does) and correctly rounded sqrt and division, so that its results
 * are the formula's in fp32, bit for bit; tests/engine/test_host_update.py holds them to a NumPy
 * transcription of it. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256
#define PACKED (BLOCK + 4) /* a block's codes, then its fp32 scale */
#define PERIOD 65536       /* quantize.NOISE_PERIOD: element i takes draw i % PERIOD */
#define MAX_THREADS 64
#define MIN_BLOCKS_PER_THREAD 64 /* below this a thread costs more than it saves */

typedef struct {
    void *master;
    int master_bf16;
    const void *grad;
    int grad_bf16;
    uint8_t *exp_avg, *exp_avg_sq;
    const float *noise_m, *noise_v; /* uniform in [0, 1), added to a code before flooring */
    const int32_t *noise_master;    /* uniform in [0, 2**16), added below bfloat16's mantissa */
    const float *hyper;             /* lr, beta1, beta2, eps, weight decay, correction1, sqrt(correction2) */
    float grad_scale;
    const uint8_t *decays; /* NULL: every element decays; else 1 where it does */
    int64_t first, last;   /* blocks */
} job_t;

static inline float bits_to_float(uint32_t bits) {
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static inline uint32_t float_to_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    return bits;
}

static void update_blocks(const job_t *job) {
    const float *h = job->hyper;
    const float lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], decay = h[4], c1 = h[5], c2_sqrt = h[6];
    const float shrink = 1.0f - lr * decay, keep1 = 1.0f - beta1, keep2 = 1.0f - beta2, step_size = lr / c1;
    const float full_m = 16129.0f, full_v = (float)4228250625.0; /* levels ** power: 127**2, 255**4 */
    float g[BLOCK], w[BLOCK], m[BLOCK], v[BLOCK];
    for (int64_t b = job->first; b < job->last; b++) {
        const int64_t e0 = b * BLOCK;
        uint8_t *restrict m_row = job->exp_avg + b * PACKED, *restrict v_row = job->exp_avg_sq + b * PACKED;
        float m_scale, v_scale;
        memcpy(&m_scale, m_row + BLOCK, 4);
        memcpy(&v_scale, v_row + BLOCK, 4);
        const float m_unit = m_scale / full_m, v_unit = v_scale / full_v;

        if (job->grad_bf16) {
            const uint16_t *restrict src = (const uint16_t *)job->grad + e0;
            for (int i = 0; i < BLOCK; i++) g[i] = bits_to_float((uint32_t)src[i] << 16) * job->grad_scale;
        } else {
            const float *restrict src = (const float *)job->grad + e0;
            for (int i = 0; i < BLOCK; i++) g[i] = src[i] * job->grad_scale;
        }
        if (job->master_bf16) {
            const uint16_t *restrict src = (const uint16_t *)job->master + e0;
            for (int i = 0; i < BLOCK; i++) w[i] = bits_to_float((uint32_t)src[i] << 16);
        } else {
            memcpy(w, (const float *)job->master + e0, sizeof w);
        }
        if (job->decays) {
            const uint8_t *restrict d = job->decays + e0;
            for (int i = 0; i < BLOCK; i++) w[i] = d[i] ? w[i] * shrink : w[i];
        } else {
            for (int i = 0; i < BLOCK; i++) w[i] = w[i] * shrink;
        }

        for (int i = 0; i < BLOCK; i++) {
            const float cm = (float)(int8_t)m_row[i], cv = (float)v_row[i];
            const float m_old = (cm * fabsf(cm)) * m_unit, v_old = ((cv * cv) * (cv * cv)) * v_unit;
            m[i] = m_old + (g[i] - m_old) * keep1;
            v[i] = v_old * beta2 + (g[i] * g[i]) * keep2;
            w[i] = w[i] - (step_size * m[i]) / (sqrtf(v[i]) / c2_sqrt + eps);
        }

        /* A magnitude's bits order as unsigned integers do, and a NaN's lie above infinity's: the
         * integer maximum is torch's amax, a NaN propagating. */
        uint32_t m_max = 0, v_max = 0;
        for (int i = 0; i < BLOCK; i++) {
            const uint32_t a = float_to_bits(m[i]) & 0x7fffffffu, c = float_to_bits(v[i]) & 0x7fffffffu;
            m_max = a > m_max ? a : m_max;
            v_max = c > v_max ? c : v_max;
        }
        const float m_abs = bits_to_float(m_max), v_abs = bits_to_float(v_max);
        const float m_factor = m_abs > 0 ? full_m / m_abs : 0.0f, v_factor = v_abs > 0 ? full_v / v_abs : 0.0f;

        const float *restrict noise_m = job->noise_m + e0 % PERIOD, *restrict noise_v = job->noise_v + e0 % PERIOD;
        for (int i = 0; i < BLOCK; i++) {
            float code = floorf(sqrtf(fabsf(m[i]) * m_factor) + noise_m[i]);
            const int32_t level = (int32_t)(code > 127.0f ? 127.0f : code);
            m_row[i] = (uint8_t)(int8_t)(float_to_bits(m[i]) >> 31 ? -level : level);
            code = floorf(sqrtf(sqrtf(v[i] * v_factor)) + noise_v[i]);
            code = code < 1.0f ? 1.0f : code; /* no code 0: see quantize.encode */
            v_row[i] = (uint8_t)(int32_t)(code > 255.0f ? 255.0f : code);
        }
        memcpy(m_row + BLOCK, &m_abs, 4);
        memcpy(v_row + BLOCK, &v_abs, 4);

        if (job->master_bf16) {
            uint16_t *restrict dst = (uint16_t *)job->master + e0;
            const int32_t *restrict noise = job->noise_master + e0 % PERIOD;
            for (int i = 0; i < BLOCK; i++) dst[i] = (uint16_t)((float_to_bits(w[i]) + (uint32_t)noise[i]) >> 16);
        } else {
            memcpy((float *)job->master + e0, w, sizeof w);
        }
    }
}

static void *run_job(void *job) {
    update_blocks((const job_t *)job);
    return NULL;
}

/* One AdamW step of a shard of numel values (a multiple of BLOCK), in place, on up to threads
 * threads; *skip nonzero leaves it as it was. */
void compact_adamw_int8(void *master, int master_bf16, const void *grad, int grad_bf16, uint8_t *exp_avg,
                        uint8_t *exp_avg_sq, const float *noise_m, const float *noise_v, const int32_t *noise_master,
                        const float *hyper, const float *grad_scale, const float *skip, const uint8_t *decays,
                        int64_t numel, int threads) {
    if (*skip != 0.0f) return;
    const int64_t blocks = numel / BLOCK;
    int64_t most = blocks / MIN_BLOCKS_PER_THREAD;
    if (threads > most) threads = most > 0 ? (int)most : 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    job_t jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started = 1;
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job_t){master, master_bf16, grad, grad_bf16, exp_avg, exp_avg_sq, noise_m, noise_v, noise_master,
                          hyper, *grad_scale, decays, blocks * t / threads, blocks * (t + 1) / threads};
    }
    for (int t = 1; t < threads; t++, started++) {
        if (pthread_create(&ids[t], NULL, run_job, &jobs[t]) != 0) break;
    }
    for (int t = started; t < threads; t++) update_blocks(&jobs[t]); /* a thread refused: this one does its part */
    update_blocks(&jobs[0]);
    for (int t = 1; t < started; t++) pthread_join(ids[t], NULL);
}
