/* kvtier_protocol._codecs: the inner loops of the quantizing codecs (SPEC.md §5), in C.
 *
 * Why this exists: the torch reference path (kvtier_protocol.codecs) makes a dozen passes over a
 * block (float32 copy, group minima and maxima, subtract, divide, round, clamp, cast, pack) and
 * runs at 0.1-1 GB/s on CPU; a disk tier writes 1-2 GB/s, so a lossy demotion would be slower
 * than a raw one. Here each block is read twice on encode (statistics, with the NaN/Inf check
 * folded in, then codes) and once on decode, with no temporaries, and the per-group scales and
 * minima between the two passes are computed here too (int_params). The integer codecs' usual
 * entry, encode_int, makes both passes over one group of rows at a time while it is in the L1
 * cache (each element converted to float32 once), with the same kernels in the same order;
 * stats, int_params and quantize remain for fp8 and for the blocks encode_int leaves to them
 * (NaN/Inf, a range overflowing float32), whose errors they decide as before.
 *
 * The bytes are exactly those of the torch path: the same IEEE-754 binary32 operations in the
 * same order, one rounding each. This file MUST be compiled without -ffast-math and with
 * -ffp-contract=off (setup.py): a fused multiply-add in the decoder, or a multiplication by a
 * reciprocal in the encoder, would change the last bit (-fno-trapping-math, which changes no
 * value, only lets gcc vectorize loops with selects). tests/protocol/test_codecs_native.py
 * compares both paths byte for byte.
 *
 * Geometry (codec_plan.CodecPlan): a quantized part is seen as [L, H, T, D]; row (l, h, t) of the
 * part starts at element base + l*sL + h*sH + t*sT of the source and holds D contiguous elements.
 * Statistics (scale, min) of a part: dim 2 ("channel" axis, groups of g tokens) are
 * [H][ceil(T/g)][D] per layer; dim 3 ("token" axis, groups of g channels) are [H][T][ceil(D/g)];
 * layer l's start at l * sstride + soff (SPEC 5.6's order when sstride sums all parts).
 * Code rows of a part: row (l, h, t) is row ((l*P + p)*H + h)*T + t of the payload, i.e. the
 * caller passes row0 = p*H*T and rows_per_layer = P*H*T.
 *
 * Source and output dtypes: 0 float32, 1 bfloat16, 2 float16 (the others use the torch path).
 * Only Python's C API and the buffer protocol: no numpy or torch headers.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

/* The element loops are compiled twice on x86-64 (baseline SSE2 and AVX2, chosen at load time by
 * the dynamic linker): 8-wide float division doubles their speed. AVX2 without FMA: the rounding
 * of every operation stays the one written here. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KERNEL __attribute__((target_clones("avx2", "default"))) static
#else
#define KERNEL static
#endif

static inline float f32_from_bits(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

/* IEEE half -> float, exact for every value (FP16 library, fp16_ieee_to_fp32_value). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t r = sign | (two_w < (1u << 27) ? f32_to_bits(denormalized) : f32_to_bits(normalized));
    return f32_from_bits(r);
}

/* float -> IEEE half, round to nearest even (FP16 library, fp16_ieee_from_fp32_value: what
 * torch's scalar conversion computes). */
static inline uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_to_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t b0 = shl1_w & 0xFF000000u;
    const uint32_t bias = b0 < 0x71000000u ? 0x71000000u : b0;  /* a select, not a branch: loops vectorize */
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_to_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* float -> bfloat16, round to nearest even (c10::detail::round_to_nearest_even). */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = f32_to_bits(f);
    const uint16_t r = (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
    return f != f ? (uint16_t)0x7FC0u : r;  /* a select, not a branch: the loop vectorizes */
}

/* Load n elements of one row as float32 (exact for every source dtype). */
KERNEL void load_row(const char *src, int dt, Py_ssize_t off, Py_ssize_t n, float *restrict out) {
    if (dt == DT_F32) {
        memcpy(out, (const float *)src + off, (size_t)n * 4);
    } else if (dt == DT_BF16) {
        const uint16_t *p = (const uint16_t *)src + off;
        for (Py_ssize_t i = 0; i < n; i++) out[i] = f32_from_bits((uint32_t)p[i] << 16);
    } else {
        const uint16_t *p = (const uint16_t *)src + off;
        for (Py_ssize_t i = 0; i < n; i++) out[i] = f16_to_f32(p[i]);
    }
}

KERNEL void store_row(char *dst, int dt, Py_ssize_t off, Py_ssize_t n, float *restrict v, float fmax) {
    for (Py_ssize_t i = 0; i < n; i++) {  /* saturate, NaN stays NaN (SPEC 5.4) */
        float y = v[i];
        y = y > fmax ? fmax : y;
        v[i] = y < -fmax ? -fmax : y;
    }
    if (dt == DT_F32) {
        memcpy((float *)dst + off, v, (size_t)n * 4);
    } else if (dt == DT_BF16) {
        uint16_t *p = (uint16_t *)dst + off;
        for (Py_ssize_t i = 0; i < n; i++) p[i] = f32_to_bf16(v[i]);
    } else {
        uint16_t *p = (uint16_t *)dst + off;
        for (Py_ssize_t i = 0; i < n; i++) p[i] = f32_to_f16(v[i]);
    }
}

/* Element loops with restrict pointers: a uint8_t store may alias anything, and without the
 * promise gcc would not vectorize them. */
KERNEL void q_vec(const float *restrict x, const float *restrict m, const float *restrict s,
                  uint8_t *restrict c, Py_ssize_t n, float qmax) {
    const float magic = 0x1.8p23f;  /* x + 1.5*2^23 - 1.5*2^23 rounds 0 <= x < 2^22 half-to-even */
    for (Py_ssize_t d = 0; d < n; d++) {
        float y = (x[d] - m[d]) / s[d];
        y = y < 0.0f ? 0.0f : y;
        y = y > qmax ? qmax : y;
        c[d] = (uint8_t)(int32_t)((y + magic) - magic);
    }
}

KERNEL void q_one(const float *restrict x, float m, float s, uint8_t *restrict c, Py_ssize_t n, float qmax) {
    const float magic = 0x1.8p23f;
    for (Py_ssize_t d = 0; d < n; d++) {
        float y = (x[d] - m) / s;
        y = y < 0.0f ? 0.0f : y;
        y = y > qmax ? qmax : y;
        c[d] = (uint8_t)(int32_t)((y + magic) - magic);
    }
}

/* fp8 encode runs as three loops over a row, each of which gcc vectorizes (one loop mixing the
 * float division with c10's integer rounding is not): y = clamp(x / S', -448, 448); t = |y| + 2^14
 * (c10's float addition that rounds a subnormal code); then the integer part of
 * c10::detail::fp8e4m3fn_from_fp32_value on the bits of y and t. Bit-identical to f32_to_e4m3. */
KERNEL void fp8_div_vec(const float *restrict x, const float *restrict s, float *restrict y, Py_ssize_t n) {
    for (Py_ssize_t d = 0; d < n; d++) {
        float v = x[d] / s[d];
        v = v < -448.0f ? -448.0f : v;
        y[d] = v > 448.0f ? 448.0f : v;
    }
}

KERNEL void fp8_div_one(const float *restrict x, float s, float *restrict y, Py_ssize_t n) {
    for (Py_ssize_t d = 0; d < n; d++) {
        float v = x[d] / s;
        v = v < -448.0f ? -448.0f : v;
        y[d] = v > 448.0f ? 448.0f : v;
    }
}

KERNEL void fp8_bias(const float *restrict y, float *restrict t, Py_ssize_t n) {
    for (Py_ssize_t d = 0; d < n; d++) t[d] = fabsf(y[d]) + 16384.0f;  /* f32_from_bits(141 << 23) */
}

KERNEL void fp8_bits(const uint32_t *restrict y, const uint32_t *restrict t, uint8_t *restrict c, Py_ssize_t n) {
    for (Py_ssize_t d = 0; d < n; d++) {
        const uint32_t w = y[d], sign = w & 0x80000000u, a = w ^ sign;
        const uint32_t denorm = t[d] - (141u << 23);
        const uint32_t norm = (a + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
        const uint32_t r = a < (121u << 23) ? denorm : norm;  /* |y| <= 448 < 480: never c10's NaN branch */
        c[d] = (uint8_t)(r | (sign >> 24));
    }
}

KERNEL void dq_vec(const uint8_t *restrict c, const float *restrict s, const float *restrict m,
                   float *restrict y, Py_ssize_t n) {
    for (Py_ssize_t d = 0; d < n; d++) { float v = (float)c[d] * s[d]; y[d] = v + m[d]; }
}

KERNEL void dq_one(const uint8_t *restrict c, float s, float m, float *restrict y, Py_ssize_t n) {
    for (Py_ssize_t d = 0; d < n; d++) { float v = (float)c[d] * s; y[d] = v + m; }
}

KERNEL void dq_fp8_vec(const uint8_t *restrict c, const float *restrict tab, const float *restrict s,
                       float *restrict y, Py_ssize_t n) {
    for (Py_ssize_t d = 0; d < n; d++) y[d] = tab[c[d]] * (s[d] * 256.0f);
}

KERNEL void dq_fp8_one(const uint8_t *restrict c, const float *restrict tab, float s, float *restrict y, Py_ssize_t n) {
    const float s256 = s * 256.0f;
    for (Py_ssize_t d = 0; d < n; d++) y[d] = tab[c[d]] * s256;
}

/* The statistics loops each make one pass over a row, folding in the check for NaN and +-Inf
 * (x - x is NaN exactly for those, and NaN != 0), so a row is read once, not twice. */
KERNEL int minmax_vec(const float *restrict x, float *restrict a, float *restrict b, Py_ssize_t n) {
    int bad = 0;
    for (Py_ssize_t d = 0; d < n; d++) {
        const float v = x[d];
        bad |= (v - v) != 0.0f;
        a[d] = v < a[d] ? v : a[d];
        b[d] = v > b[d] ? v : b[d];
    }
    return bad;
}

KERNEL int absmax_vec(const float *restrict x, float *restrict a, Py_ssize_t n) {
    int bad = 0;
    for (Py_ssize_t d = 0; d < n; d++) {
        const float v = fabsf(x[d]);
        bad |= (v - v) != 0.0f;
        a[d] = v > a[d] ? v : a[d];
    }
    return bad;
}

/* One group's reduction (the "token" axis: a row's group of g channels). gcc vectorizes no float
 * min/max reduction without -ffast-math (nor a few scalar accumulators: it keeps them scalar), so
 * the running minima and maxima are GCC vector-extension values of VL floats (one AVX2 register
 * in the AVX2 clone, two SSE registers otherwise), folded at the end; a ragged tail is folded
 * in scalar. The comparisons and selects are the scalar ones, lane by lane: the minimum and
 * maximum do not depend on the order, only the sign of a zero extremum might. */
#define VL 8
typedef float vfloat __attribute__((vector_size(VL * 4)));
typedef int32_t vint __attribute__((vector_size(VL * 4)));
/* m ? x : y lane by lane, m a comparison's mask (all ones or zero): C has no vector ?: */
#define VSEL(m, x, y) ((vfloat)(((m) & (vint)(x)) | (~(m) & (vint)(y))))

KERNEL int minmax_one(const float *restrict x, Py_ssize_t n, float *restrict lo, float *restrict hi) {
    vfloat a, b;
    vint bad = {0};
    for (int k = 0; k < VL; k++) { a[k] = INFINITY; b[k] = -INFINITY; }
    Py_ssize_t d = 0;
    for (; d + VL <= n; d += VL) {
        vfloat v;
        memcpy(&v, x + d, sizeof v);
        bad |= (v - v) != 0.0f;
        a = VSEL(v < a, v, a);
        b = VSEL(v > b, v, b);
    }
    float fa = a[0], fb = b[0];
    int fbad = bad[0] != 0;
    for (int k = 1; k < VL; k++) {
        fa = a[k] < fa ? a[k] : fa;
        fb = b[k] > fb ? b[k] : fb;
        fbad |= bad[k] != 0;
    }
    for (; d < n; d++) {
        const float v = x[d];
        fbad |= (v - v) != 0.0f;
        fa = v < fa ? v : fa;
        fb = v > fb ? v : fb;
    }
    *lo = fa;
    *hi = fb;
    return fbad;
}

KERNEL int absmax_one(const float *restrict x, Py_ssize_t n, float *restrict out) {
    vint sign;
    for (int k = 0; k < VL; k++) sign[k] = INT32_MIN;  /* the sign bit of each lane */
    vfloat a = {0};
    vint bad = {0};
    Py_ssize_t d = 0;
    for (; d + VL <= n; d += VL) {
        vfloat v;
        memcpy(&v, x + d, sizeof v);
        v = (vfloat)((vint)v & ~sign);  /* fabsf */
        bad |= (v - v) != 0.0f;
        a = VSEL(v > a, v, a);
    }
    float fa = a[0];
    int fbad = bad[0] != 0;
    for (int k = 1; k < VL; k++) {
        fa = a[k] > fa ? a[k] : fa;
        fbad |= bad[k] != 0;
    }
    for (; d < n; d++) {
        const float v = fabsf(x[d]);
        fbad |= (v - v) != 0.0f;
        fa = v > fa ? v : fa;
    }
    *out = fa;
    return fbad;
}

/* Per-group parameters of the integer codecs from the statistics (see int_params below): each
 * loop vectorizes. scale = (max - min) / qmax (two roundings, as the torch path), the flags that
 * refuse the block (a scale overflowing float32) or the float16 scale dtype (a scale above
 * 65504 or a positive one below 2^-14, a minimum beyond +-65504: _fits_fp16). */
KERNEL int scale_flags(const float *restrict lo, const float *restrict hi, float *restrict sc, Py_ssize_t n,
                       float qmax, int *restrict nofit) {
    int bad = 0, big = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const float v = (hi[i] - lo[i]) / qmax;
        sc[i] = v;
        bad |= (v - v) != 0.0f;
        big |= (v > 65504.0f) | ((v > 0.0f) & (v < 0x1.0p-14f)) | (fabsf(lo[i]) > 65504.0f);
    }
    *nofit = big;
    return bad;
}

/* Stored float16 scales and minima (round to nearest even), and the float32 values the codes are
 * computed from: the stored ones read back, a zero scale as +Inf (every code of the group 0). */
KERNEL void store_f16_params(const float *restrict lo, float *restrict sc, uint16_t *restrict ss,
                             uint16_t *restrict sm, float *restrict mn, Py_ssize_t n) {
    /* three simple loops: gcc vectorizes each, not one that does all of it */
    for (Py_ssize_t i = 0; i < n; i++) {
        ss[i] = f32_to_f16(sc[i]);
        sm[i] = f32_to_f16(lo[i]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        sc[i] = f16_to_f32(ss[i]);
        mn[i] = f16_to_f32(sm[i]);
    }
    for (Py_ssize_t i = 0; i < n; i++) sc[i] = sc[i] > 0.0f ? sc[i] : INFINITY;
}

KERNEL void store_f32_params(const float *restrict lo, float *restrict sc, float *restrict ss,
                             float *restrict sm, float *restrict mn, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const float v = sc[i];
        ss[i] = v;
        sm[i] = lo[i];
        sc[i] = v > 0.0f ? v : INFINITY;
        mn[i] = lo[i];
    }
}

typedef struct {
    Py_ssize_t L, H, T, D, base, sL, sH, sT, dim, g, soff, sstride;
} Geom;

/* Statistics of one (l, h) of a part: [G][D] ("channel") or [T][G] ("token"). */
static Py_ssize_t per_head(const Geom *q) {
    return q->dim == 2 ? ((q->T + q->g - 1) / q->g) * q->D : q->T * ((q->D + q->g - 1) / q->g);
}

/* Index of the first statistic of row (l, h, t): layer l's statistics start at l * sstride, the
 * part's at soff within them (SPEC 5.6: layer-major, then part), so the scales and mins sections
 * are the statistics buffers themselves. */
static inline Py_ssize_t stat0(const Geom *q, Py_ssize_t G, Py_ssize_t l, Py_ssize_t h, Py_ssize_t t) {
    return l * q->sstride + q->soff + h * per_head(q) + (q->dim == 2 ? (t / q->g) * q->D : t * G);
}

static int geom_ok(const Geom *q) {
    if (q->L < 1 || q->H < 1 || q->T < 1 || q->D < 1 || q->g < 1 || q->base < 0 || q->sL < 0 || q->sH < 0
        || q->sT < 0 || (q->dim != 2 && q->dim != 3) || q->soff < 0 || q->sstride < 0) {
        PyErr_SetString(PyExc_ValueError, "bad geometry");
        return 0;
    }
    return 1;
}

/* Number of elements a part's rows span in its buffer (last element + 1). */
static Py_ssize_t span(const Geom *q) {
    return q->base + (q->L - 1) * q->sL + (q->H - 1) * q->sH + (q->T - 1) * q->sT + q->D;
}

/* Number of statistics the part's placement spans (last + 1). */
static Py_ssize_t nstats(const Geom *q) {
    return (q->L - 1) * q->sstride + q->soff + q->H * per_head(q);
}

static const int DT_SIZE[3] = {4, 2, 2};

static int check_buf(Py_buffer *b, Py_ssize_t need, const char *what) {
    if (b->len < need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", what, b->len, need);
        return 0;
    }
    return 1;
}

#define GEOM_FMT "nnnnnnnnnnnn"
#define GEOM_ARGS(q) &(q).L, &(q).H, &(q).T, &(q).D, &(q).base, &(q).sL, &(q).sH, &(q).sT, &(q).dim, &(q).g, \
    &(q).soff, &(q).sstride

/* stats(src, dtype, L, H, T, D, base, sL, sH, sT, dim, g, soff, sstride, absmax, lo, hi) -> any NaN seen.
 * absmax = 0: lo/hi get each group's minimum/maximum; 1: lo gets max |x| and hi is ignored.
 * Returns whether any element is NaN or +-Inf (the statistics are then meaningless). */
static PyObject *stats(PyObject *self, PyObject *args) {
    Py_buffer src, lo, hi;
    int dt, absmax;
    Geom q;
    if (!PyArg_ParseTuple(args, "y*i" GEOM_FMT "pw*w*", &src, &dt, GEOM_ARGS(q), &absmax, &lo, &hi)) return NULL;
    PyObject *ret = NULL;
    float *row = NULL;
    if (dt < 0 || dt > 2 || !geom_ok(&q) || !check_buf(&src, span(&q) * DT_SIZE[dt], "src")
        || !check_buf(&lo, nstats(&q) * 4, "lo") || (!absmax && !check_buf(&hi, nstats(&q) * 4, "hi")))
        goto done;
    row = PyMem_RawMalloc((size_t)q.D * 4);
    if (!row) { PyErr_NoMemory(); goto done; }
    int nan = 0;
    Py_BEGIN_ALLOW_THREADS
    float *plo = lo.buf, *phi = hi.buf;
    const Py_ssize_t G = q.dim == 2 ? (q.T + q.g - 1) / q.g : (q.D + q.g - 1) / q.g;
    for (Py_ssize_t l = 0; l < q.L; l++) {
        for (Py_ssize_t h = 0; h < q.H; h++) {
            const Py_ssize_t sbase = stat0(&q, G, l, h, 0);
            if (q.dim == 2) {
                for (Py_ssize_t i = 0; i < G * q.D; i++) {
                    plo[sbase + i] = absmax ? 0.0f : INFINITY;
                    if (!absmax) phi[sbase + i] = -INFINITY;
                }
            }
            for (Py_ssize_t t = 0; t < q.T; t++) {
                load_row(src.buf, dt, q.base + l * q.sL + h * q.sH + t * q.sT, q.D, row);
                if (q.dim == 2) {
                    float *a = plo + sbase + (t / q.g) * q.D, *b = phi + sbase + (t / q.g) * q.D;
                    nan |= absmax ? absmax_vec(row, a, q.D) : minmax_vec(row, a, b, q.D);
                } else {
                    for (Py_ssize_t j = 0; j < G; j++) {
                        const Py_ssize_t d0 = j * q.g, d1 = d0 + q.g < q.D ? d0 + q.g : q.D;
                        float *a = plo + sbase + t * G + j;
                        nan |= absmax ? absmax_one(row + d0, d1 - d0, a)
                                      : minmax_one(row + d0, d1 - d0, a, phi + sbase + t * G + j);
                    }
                }
            }
        }
    }
    Py_END_ALLOW_THREADS
    ret = PyBool_FromLong(nan);
done:
    PyMem_RawFree(row);
    PyBuffer_Release(&src);
    PyBuffer_Release(&lo);
    PyBuffer_Release(&hi);
    return ret;
}

/* int_params(lo, hi, qmax, f16, stored_scales, stored_mins, div, mins) -> 0, 1 or 2: the
 * integer codecs' per-group parameters from stats()' minima and maxima (float32, n of each), as
 * the torch path computes them. 1: a scale overflows float32 (nothing usable written); 2 (f16
 * only): float16 cannot hold the scales or minima, call again with f16 = 0. Otherwise
 * stored_scales / stored_mins get the sections' values (float16 or float32, n of each) and
 * div / mins (float32) what the codes are computed from: the stored values read back, a zero
 * scale as +Inf. One pass and two vectorized loops instead of a dozen small torch operations
 * (~0.4 ms per 2 MiB block, a third of its encode). */
static PyObject *int_params(PyObject *self, PyObject *args) {
    Py_buffer lo, hi, ss, sm, dv, mn;
    float qmax;
    int f16;
    if (!PyArg_ParseTuple(args, "y*y*fpw*w*w*w*", &lo, &hi, &qmax, &f16, &ss, &sm, &dv, &mn)) return NULL;
    PyObject *ret = NULL;
    const Py_ssize_t n = lo.len / 4, es = f16 ? 2 : 4;
    if (lo.len % 4 || !check_buf(&hi, n * 4, "hi") || !check_buf(&ss, n * es, "stored_scales")
        || !check_buf(&sm, n * es, "stored_mins") || !check_buf(&dv, n * 4, "div") || !check_buf(&mn, n * 4, "mins"))
        goto done;
    if (!(qmax > 0.0f)) {
        PyErr_SetString(PyExc_ValueError, "qmax must be positive");
        goto done;
    }
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    int nofit = 0;
    if (scale_flags(lo.buf, hi.buf, dv.buf, n, qmax, &nofit)) status = 1;
    else if (f16 && nofit) status = 2;
    else if (f16) store_f16_params(lo.buf, dv.buf, ss.buf, sm.buf, mn.buf, n);
    else store_f32_params(lo.buf, dv.buf, ss.buf, sm.buf, mn.buf, n);
    Py_END_ALLOW_THREADS
    ret = PyLong_FromLong(status);
done:
    PyBuffer_Release(&lo);
    PyBuffer_Release(&hi);
    PyBuffer_Release(&ss);
    PyBuffer_Release(&sm);
    PyBuffer_Release(&dv);
    PyBuffer_Release(&mn);
    return ret;
}

/* quantize(src, dtype, L, H, T, D, base, sL, sH, sT, dim, g, soff, sstride, bits, div, mins, out, row0, rows_per_layer)
 * bits 8/4/2: integer codes q = clamp(rne((x - M) / S'), 0, qmax), packed LSB first, one row per
 * (l, h, t); bits 0: fp8 e4m3 codes of clamp(x / S', -448, 448), one byte each (mins ignored).
 * div holds S' = S where S > 0 and +Inf where S = 0 (so every code of a constant group is 0),
 * float32, in the statistics' order. */
static PyObject *quantize(PyObject *self, PyObject *args) {
    Py_buffer src, div, mins, out;
    int dt, bits;
    Geom q;
    Py_ssize_t row0, rows_per_layer;
    if (!PyArg_ParseTuple(args, "y*i" GEOM_FMT "iy*y*w*nn", &src, &dt, GEOM_ARGS(q), &bits, &div, &mins, &out,
                          &row0, &rows_per_layer))
        return NULL;
    PyObject *ret = NULL;
    float *row = NULL;
    uint8_t *codes = NULL;
    const int fp8 = bits == 0;
    const int b = fp8 ? 8 : bits;
    const Py_ssize_t rowbytes = (q.D * b + 7) / 8;
    if (dt < 0 || dt > 2 || (bits != 0 && bits != 2 && bits != 4 && bits != 8) || !geom_ok(&q) || row0 < 0
        || rows_per_layer < q.H * q.T || !check_buf(&src, span(&q) * DT_SIZE[dt], "src")
        || !check_buf(&div, nstats(&q) * 4, "div") || (!fp8 && !check_buf(&mins, nstats(&q) * 4, "mins"))
        || !check_buf(&out, ((q.L - 1) * rows_per_layer + row0 + q.H * q.T) * rowbytes, "out"))
        goto done;
    row = PyMem_RawMalloc((size_t)q.D * 12);  /* the row, then fp8's two scratch rows */
    codes = PyMem_RawMalloc((size_t)q.D + 8);
    if (!row || !codes) { PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    float *ya = row + q.D, *yb = row + 2 * q.D;
    const float *pdiv = div.buf, *pmin = fp8 ? NULL : (const float *)mins.buf;
    const float qmax = (float)((1 << b) - 1);
    const Py_ssize_t G = q.dim == 2 ? (q.T + q.g - 1) / q.g : (q.D + q.g - 1) / q.g;
    for (Py_ssize_t l = 0; l < q.L; l++) {
        for (Py_ssize_t h = 0; h < q.H; h++) {
            for (Py_ssize_t t = 0; t < q.T; t++) {
                load_row(src.buf, dt, q.base + l * q.sL + h * q.sH + t * q.sT, q.D, row);
                uint8_t *dst = (uint8_t *)out.buf + (l * rows_per_layer + row0 + h * q.T + t) * rowbytes;
                uint8_t *c = b == 8 ? dst : codes;
                const Py_ssize_t s0 = stat0(&q, G, l, h, t);
                for (Py_ssize_t j = 0; j < (q.dim == 2 ? 1 : G); j++) {
                    const Py_ssize_t d0 = q.dim == 2 ? 0 : j * q.g;
                    const Py_ssize_t d1 = q.dim == 2 ? q.D : (d0 + q.g < q.D ? d0 + q.g : q.D);
                    if (fp8)
                        {
                        if (q.dim == 2) fp8_div_vec(row, pdiv + s0, ya, q.D);
                        else fp8_div_one(row + d0, pdiv[s0 + j], ya + d0, d1 - d0);
                    }
                    else if (q.dim == 2)
                        q_vec(row, pmin + s0, pdiv + s0, c, q.D, qmax);
                    else
                        q_one(row + d0, pmin[s0 + j], pdiv[s0 + j], c + d0, d1 - d0, qmax);
                }
                if (fp8) {
                    fp8_bias(ya, yb, q.D);
                    fp8_bits((const uint32_t *)ya, (const uint32_t *)yb, c, q.D);
                }
                if (b == 4) {
                    codes[q.D] = 0;
                    for (Py_ssize_t k = 0; k < rowbytes; k++) dst[k] = (uint8_t)(codes[2 * k] | (codes[2 * k + 1] << 4));
                } else if (b == 2) {
                    codes[q.D] = codes[q.D + 1] = codes[q.D + 2] = 0;
                    for (Py_ssize_t k = 0; k < rowbytes; k++)
                        dst[k] = (uint8_t)(codes[4 * k] | (codes[4 * k + 1] << 2) | (codes[4 * k + 2] << 4)
                                           | (codes[4 * k + 3] << 6));
                }
            }
        }
    }
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done:
    PyMem_RawFree(row);
    PyMem_RawFree(codes);
    PyBuffer_Release(&src);
    PyBuffer_Release(&div);
    PyBuffer_Release(&mins);
    PyBuffer_Release(&out);
    return ret;
}

/* Pack one row's codes (one byte each in c, at least D + 3 of them writable) into dst. */
static void pack_row(uint8_t *restrict c, uint8_t *restrict dst, Py_ssize_t D, int b, Py_ssize_t rowbytes) {
    if (b == 4) {
        c[D] = 0;
        for (Py_ssize_t k = 0; k < rowbytes; k++) dst[k] = (uint8_t)(c[2 * k] | (c[2 * k + 1] << 4));
    } else if (b == 2) {
        c[D] = c[D + 1] = c[D + 2] = 0;
        for (Py_ssize_t k = 0; k < rowbytes; k++)
            dst[k] = (uint8_t)(c[4 * k] | (c[4 * k + 1] << 2) | (c[4 * k + 2] << 4) | (c[4 * k + 3] << 6));
    }
}

/* The stored parameters of n groups from their minima and maxima, as int_params computes them (the
 * same kernels, the same order): 0, or int_params' status 1 / 2 (nothing usable written then). */
static int group_params(const float *lo, const float *hi, float *dv, float *mn, char *ss, char *sm, Py_ssize_t s0,
                        Py_ssize_t n, float qmax, int f16) {
    int nofit = 0;
    if (scale_flags(lo, hi, dv, n, qmax, &nofit)) return 1;
    if (f16 && nofit) return 2;
    if (f16) store_f16_params(lo, dv, (uint16_t *)ss + s0, (uint16_t *)sm + s0, mn, n);
    else store_f32_params(lo, dv, (float *)ss + s0, (float *)sm + s0, mn, n);
    return 0;
}

/* encode_int(src, dtype, L, H, T, D, base, sL, sH, sT, dim, g, soff, sstride, bits, f16, out, scales, mins,
 *            row0, rows_per_layer) -> 0, or the status that sends the caller to the unfused path.
 * stats, int_params and quantize of one part in one pass over it: each group of rows (dim 2: g
 * tokens of one (l, h); dim 3: one token) is loaded as float32 once, its statistics and stored
 * parameters are computed, and its codes written while it is still in the L1 cache; the stored
 * scales and minima (float16 when f16, else float32) go straight into the sections' buffers in the
 * statistics' order. Every value comes from the kernels the unfused calls use, in the same order:
 * the same bytes. Status: 1 a scale overflows float32, 2 (f16 only) float16 cannot hold a
 * group's parameters, 3 NaN or Inf in the part; the outputs are then partly written, and the caller
 * decides the error (or the float32 fall-back) with the unfused calls, as it would have. */
static PyObject *encode_int(PyObject *self, PyObject *args) {
    Py_buffer src, out, ss, sm;
    int dt, bits, f16;
    Geom q;
    Py_ssize_t row0, rows_per_layer;
    if (!PyArg_ParseTuple(args, "y*i" GEOM_FMT "ipw*w*w*nn", &src, &dt, GEOM_ARGS(q), &bits, &f16, &out, &ss, &sm,
                          &row0, &rows_per_layer))
        return NULL;
    PyObject *ret = NULL;
    float *tile = NULL;
    uint8_t *codes = NULL;
    const Py_ssize_t rowbytes = (q.D * bits + 7) / 8, es = f16 ? 2 : 4;
    if (dt < 0 || dt > 2 || (bits != 2 && bits != 4 && bits != 8) || !geom_ok(&q) || row0 < 0
        || rows_per_layer < q.H * q.T || !check_buf(&src, span(&q) * DT_SIZE[dt], "src")
        || !check_buf(&ss, nstats(&q) * es, "scales") || !check_buf(&sm, nstats(&q) * es, "mins")
        || !check_buf(&out, ((q.L - 1) * rows_per_layer + row0 + q.H * q.T) * rowbytes, "out"))
        goto done;
    /* dim 2: the g rows of a group, then lo, hi, div, min of its D channels; dim 3: gr rows (about
     * 16 KiB of them: in L1 until their codes are written), then lo, hi, div, min of their gr x G groups */
    const Py_ssize_t G = q.dim == 2 ? (q.T + q.g - 1) / q.g : (q.D + q.g - 1) / q.g;
    const Py_ssize_t rows16k = 4096 / q.D > 1 ? 4096 / q.D : 1;
    const Py_ssize_t gr = q.dim == 2 ? (q.g < q.T ? q.g : q.T) : (rows16k < q.T ? rows16k : q.T);
    const Py_ssize_t np = q.dim == 2 ? q.D : gr * G;
    tile = PyMem_RawMalloc((size_t)(gr * q.D + 4 * np) * 4);
    codes = PyMem_RawMalloc((size_t)q.D + 8);
    if (!tile || !codes) { PyErr_NoMemory(); goto done; }
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    float *lo = tile + gr * q.D, *hi = lo + np, *dv = hi + np, *mn = dv + np;
    const float qmax = (float)((1 << bits) - 1);
    for (Py_ssize_t l = 0; l < q.L && !status; l++) {
        for (Py_ssize_t h = 0; h < q.H && !status; h++) {
            if (q.dim == 2) {
                for (Py_ssize_t j = 0; j < G && !status; j++) {
                    const Py_ssize_t t0 = j * q.g, t1 = t0 + q.g < q.T ? t0 + q.g : q.T;
                    for (Py_ssize_t d = 0; d < q.D; d++) { lo[d] = INFINITY; hi[d] = -INFINITY; }
                    int bad = 0;
                    for (Py_ssize_t t = t0; t < t1; t++) {
                        float *row = tile + (t - t0) * q.D;
                        load_row(src.buf, dt, q.base + l * q.sL + h * q.sH + t * q.sT, q.D, row);
                        bad |= minmax_vec(row, lo, hi, q.D);
                    }
                    if (bad) { status = 3; break; }
                    status = group_params(lo, hi, dv, mn, ss.buf, sm.buf, stat0(&q, G, l, h, t0), q.D, qmax, f16);
                    for (Py_ssize_t t = t0; t < t1 && !status; t++) {
                        uint8_t *dst = (uint8_t *)out.buf + (l * rows_per_layer + row0 + h * q.T + t) * rowbytes;
                        uint8_t *c = bits == 8 ? dst : codes;
                        q_vec(tile + (t - t0) * q.D, mn, dv, c, q.D, qmax);
                        pack_row(c, dst, q.D, bits, rowbytes);
                    }
                }
            } else {
                /* gr tokens at a time: their statistics are contiguous (stat0), so one
                 * group_params call serves gr * G groups instead of G per token */
                for (Py_ssize_t t0 = 0; t0 < q.T && !status; t0 += gr) {
                    const Py_ssize_t t1 = t0 + gr < q.T ? t0 + gr : q.T;
                    int bad = 0;
                    for (Py_ssize_t t = t0; t < t1; t++) {
                        float *row = tile + (t - t0) * q.D;
                        load_row(src.buf, dt, q.base + l * q.sL + h * q.sH + t * q.sT, q.D, row);
                        for (Py_ssize_t j = 0; j < G; j++) {
                            const Py_ssize_t d0 = j * q.g, d1 = d0 + q.g < q.D ? d0 + q.g : q.D, k = (t - t0) * G + j;
                            bad |= minmax_one(row + d0, d1 - d0, lo + k, hi + k);
                        }
                    }
                    if (bad) { status = 3; break; }
                    status = group_params(lo, hi, dv, mn, ss.buf, sm.buf, stat0(&q, G, l, h, t0), (t1 - t0) * G, qmax, f16);
                    for (Py_ssize_t t = t0; t < t1 && !status; t++) {
                        uint8_t *dst = (uint8_t *)out.buf + (l * rows_per_layer + row0 + h * q.T + t) * rowbytes;
                        uint8_t *c = bits == 8 ? dst : codes;
                        const float *row = tile + (t - t0) * q.D, *pm = mn + (t - t0) * G, *pd = dv + (t - t0) * G;
                        for (Py_ssize_t j = 0; j < G; j++) {
                            const Py_ssize_t d0 = j * q.g, d1 = d0 + q.g < q.D ? d0 + q.g : q.D;
                            q_one(row + d0, pm[j], pd[j], c + d0, d1 - d0, qmax);
                        }
                        pack_row(c, dst, q.D, bits, rowbytes);
                    }
                }
            }
        }
    }
    Py_END_ALLOW_THREADS
    ret = PyLong_FromLong(status);
done:
    PyMem_RawFree(tile);
    PyMem_RawFree(codes);
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    PyBuffer_Release(&ss);
    PyBuffer_Release(&sm);
    return ret;
}

/* dequantize(codes, bits, row0, rows_per_layer, scales, mins, fp8_table, out, dtype, fmax,
 *            L, H, T, D, base, sL, sH, sT, dim, g, soff, sstride)
 * bits 8/4/2: y = (q * S) + M (two roundings); bits 0: y = table[q] * (S * 256) where table holds
 * the 256 fp8 values times 2^-8 (the torch path's own table); then saturated to +-fmax and
 * converted to the output dtype (round to nearest even). The geometry describes the output. */
static PyObject *dequantize(PyObject *self, PyObject *args) {
    Py_buffer codesb, scales, mins, table, out;
    int bits, dt;
    float fmax;
    Py_ssize_t row0, rows_per_layer;
    Geom q;
    if (!PyArg_ParseTuple(args, "y*inny*y*y*w*if" GEOM_FMT, &codesb, &bits, &row0, &rows_per_layer, &scales, &mins,
                          &table, &out, &dt, &fmax, GEOM_ARGS(q)))
        return NULL;
    PyObject *ret = NULL;
    float *row = NULL;
    uint8_t *codes = NULL;
    const int fp8 = bits == 0;
    const int b = fp8 ? 8 : bits;
    const Py_ssize_t rowbytes = (q.D * b + 7) / 8;
    if (dt < 0 || dt > 2 || (bits != 0 && bits != 2 && bits != 4 && bits != 8) || !geom_ok(&q) || row0 < 0
        || rows_per_layer < q.H * q.T || !check_buf(&out, span(&q) * DT_SIZE[dt], "out")
        || !check_buf(&scales, nstats(&q) * 4, "scales") || (!fp8 && !check_buf(&mins, nstats(&q) * 4, "mins"))
        || (fp8 && !check_buf(&table, 256 * 4, "table"))
        || !check_buf(&codesb, ((q.L - 1) * rows_per_layer + row0 + q.H * q.T) * rowbytes, "codes"))
        goto done;
    row = PyMem_RawMalloc((size_t)q.D * 4);
    codes = PyMem_RawMalloc((size_t)q.D + 8);
    if (!row || !codes) { PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    const float *ps = scales.buf, *pm = fp8 ? NULL : (const float *)mins.buf, *tab = fp8 ? table.buf : NULL;
    const Py_ssize_t G = q.dim == 2 ? (q.T + q.g - 1) / q.g : (q.D + q.g - 1) / q.g;
    for (Py_ssize_t l = 0; l < q.L; l++) {
        for (Py_ssize_t h = 0; h < q.H; h++) {
            for (Py_ssize_t t = 0; t < q.T; t++) {
                const uint8_t *src = (const uint8_t *)codesb.buf + (l * rows_per_layer + row0 + h * q.T + t) * rowbytes;
                const uint8_t *c = src;
                if (b == 4) {
                    for (Py_ssize_t k = 0; k < rowbytes; k++) { codes[2 * k] = src[k] & 15; codes[2 * k + 1] = src[k] >> 4; }
                    c = codes;
                } else if (b == 2) {
                    for (Py_ssize_t k = 0; k < rowbytes; k++) {
                        codes[4 * k] = src[k] & 3; codes[4 * k + 1] = (src[k] >> 2) & 3;
                        codes[4 * k + 2] = (src[k] >> 4) & 3; codes[4 * k + 3] = src[k] >> 6;
                    }
                    c = codes;
                }
                const Py_ssize_t s0 = stat0(&q, G, l, h, t);
                if (q.dim == 2) {
                    if (fp8) dq_fp8_vec(c, tab, ps + s0, row, q.D);
                    else dq_vec(c, ps + s0, pm + s0, row, q.D);
                } else {
                    for (Py_ssize_t j = 0; j < G; j++) {
                        const Py_ssize_t d0 = j * q.g, d1 = d0 + q.g < q.D ? d0 + q.g : q.D;
                        if (fp8) dq_fp8_one(c + d0, tab, ps[s0 + j], row + d0, d1 - d0);
                        else dq_one(c + d0, ps[s0 + j], pm[s0 + j], row + d0, d1 - d0);
                    }
                }
                store_row(out.buf, dt, q.base + l * q.sL + h * q.sH + t * q.sT, q.D, row, fmax);
            }
        }
    }
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done:
    PyMem_RawFree(row);
    PyMem_RawFree(codes);
    PyBuffer_Release(&codesb);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&mins);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    return ret;
}

/* shuffle(src, dst, stride, inverse): byte shuffle of the compression stage (SPEC 4.8): the
 * n/stride elements of `stride` bytes each, transposed so that byte k of every element comes
 * before byte k+1 of any; inverse = 1 undoes it. n must be a multiple of stride. */
static PyObject *shuffle(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t stride;
    int inverse;
    if (!PyArg_ParseTuple(args, "y*w*np", &src, &dst, &stride, &inverse)) return NULL;
    PyObject *ret = NULL;
    if (stride < 1 || src.len % stride || dst.len != src.len) {
        PyErr_SetString(PyExc_ValueError, "shuffle: lengths must be equal multiples of the stride");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *s = src.buf;
    uint8_t *d = dst.buf;
    const Py_ssize_t n = src.len / stride;
    for (Py_ssize_t k = 0; k < stride; k++) {
        if (inverse) {
            const uint8_t *sk = s + k * n;
            for (Py_ssize_t i = 0; i < n; i++) d[i * stride + k] = sk[i];
        } else {
            uint8_t *dk = d + k * n;
            for (Py_ssize_t i = 0; i < n; i++) dk[i] = s[i * stride + k];
        }
    }
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return ret;
}

static PyMethodDef methods[] = {
    {"stats", stats, METH_VARARGS, "Group minima and maxima (or max |x|) of one quantized part."},
    {"int_params", int_params, METH_VARARGS, "Scales, minima and divisors of the integer codecs from the statistics."},
    {"quantize", quantize, METH_VARARGS, "Codes of one quantized part, packed into payload rows."},
    {"encode_int", encode_int, METH_VARARGS, "stats, int_params and quantize of one integer-coded part in one pass."},
    {"dequantize", dequantize, METH_VARARGS, "Decode one quantized part into the output tensor's memory."},
    {"shuffle", shuffle, METH_VARARGS, "Byte shuffle (or its inverse) of the compression stage."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier_protocol._codecs",
                                    "Inner loops of the quantizing codecs (SPEC.md §5); see _codecs.c.", -1, methods};

PyMODINIT_FUNC PyInit__codecs(void) { return PyModule_Create(&module); }
