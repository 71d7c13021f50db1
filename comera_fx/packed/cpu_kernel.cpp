// comera_fx packed layers: y = x W^T (+ b) with W read from int4 / int8 codes inside the product (no weight rebuilt).
//
// Layout (PackedLinear, code_format 3): output rows in blocks of 16. Codes: [N/16][width][16] bytes, byte (b, j, i)
// is row 16 b + i; for int4 its low nibble is input feature j and its high nibble feature j + K/2 (each a 4-bit
// two's complement code), width = K/2; for int8 it is feature j, width = K. Scales: [N/16][G][16] floats, one per
// row and group of kgroup input features. For each input feature the 16 rows' codes of a block are one vector of
// 16 floats after widening, so the kernel is an outer product: every token's x value broadcast times that vector,
// accumulated in registers over all K features (no horizontal sums), the codes widened once per token tile.
//
// Two builds of this file (cpu_kernel.py picks the one the CPU runs): AVX-512 (-mavx512f -mavx512bw: a vector of
// 16 floats is one register, 32 registers) and AVX2 (-mavx2 -mfma: two registers, 16 of them; fewer rows a tile).
#include <immintrin.h>
#include <stdint.h>

#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct V16 { // 16 floats
    __m512 v;
};
struct I16 { // 16 int32
    __m512i v;
};
static inline V16 vzero() { return {_mm512_setzero_ps()}; }
static inline V16 vload(const float *p) { return {_mm512_loadu_ps(p)}; }
static inline void vstore(float *p, V16 a) { _mm512_storeu_ps(p, a.v); }
static inline V16 vset1(float x) { return {_mm512_set1_ps(x)}; }
static inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V16 vfmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline I16 ifrom_bytes(__m128i b) { return {_mm512_cvtepi8_epi32(b)}; }                   // sign-extended
static inline I16 ifrom_words(__m128i lo8, __m128i hi8) { return {_mm512_cvtepi16_epi32(_mm256_set_m128i(hi8, lo8))}; }
static inline I16 ilow_nibbles(I16 a) { return {_mm512_srai_epi32(_mm512_slli_epi32(a.v, 28), 28)}; }
static inline I16 ihigh_nibbles(I16 a) { return {_mm512_srai_epi32(a.v, 4)}; }
static inline V16 vfrom(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
static inline void vstore_bf16(void *p, V16 a) { // the fp32 value's top half: exact for small integers
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(a.v), 16)));
}
#define ROW_BLOCKS 4 // 64 output rows a tile: 4 x TOKENS accumulators + 8 weight vectors fit 32 registers
#define TOKENS 6
#elif defined(__AVX2__) && defined(__FMA__)
struct V16 {
    __m256 a, b;
};
struct I16 {
    __m256i a, b;
};
static inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V16 vload(const float *p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float *p, V16 x) {
    _mm256_storeu_ps(p, x.a);
    _mm256_storeu_ps(p + 8, x.b);
}
static inline V16 vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline V16 vadd(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
static inline V16 vmul(V16 x, V16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline V16 vfmadd(V16 x, V16 y, V16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
static inline I16 ifrom_bytes(__m128i b) { return {_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))}; }
static inline I16 ifrom_words(__m128i lo8, __m128i hi8) { return {_mm256_cvtepi16_epi32(lo8), _mm256_cvtepi16_epi32(hi8)}; }
static inline I16 ilow_nibbles(I16 x) {
    return {_mm256_srai_epi32(_mm256_slli_epi32(x.a, 28), 28), _mm256_srai_epi32(_mm256_slli_epi32(x.b, 28), 28)};
}
static inline I16 ihigh_nibbles(I16 x) { return {_mm256_srai_epi32(x.a, 4), _mm256_srai_epi32(x.b, 4)}; }
static inline V16 vfrom(I16 x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
static inline void vstore_bf16(void *p, V16 x) {
    __m256i words = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(x.a), 16),
                                        _mm256_srli_epi32(_mm256_castps_si256(x.b), 16));
    _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(words, 0xD8)); // packus interleaves the lanes
}
#define ROW_BLOCKS 1 // 16 output rows a tile: 2 x TOKENS accumulators + 4 weight vectors + 2 broadcasts
#define TOKENS 4
#else
#error "cpu_kernel.cpp needs AVX-512 (F, BW) or AVX2 with FMA"
#endif

#define SCRATCH_MIN_TOKENS 24 // from this many tokens, widen a tile's weights once into scratch (see product)

// The weight vectors of input feature j for the tile's row blocks r (lo: feature j, hi: int4's feature j + K/2),
// widened from the codes and scaled.
template <int BITS> struct FromCodes {
    const uint8_t *codes;
    const float *scales;
    int64_t width, G, kgroup, b0;
    inline void load(int64_t j, int r, V16 &lo, V16 &hi) const {
        const uint8_t *c = codes + ((b0 + r) * width + j) * 16;
        const float *s = scales + (b0 + r) * G * 16;
        I16 v = ifrom_bytes(_mm_loadu_si128((const __m128i *)c));
        if (BITS == 4) {
            lo = vmul(vfrom(ilow_nibbles(v)), vload(s + (j / kgroup) * 16));
            hi = vmul(vfrom(ihigh_nibbles(v)), vload(s + ((j + width) / kgroup) * 16));
        } else {
            lo = vmul(vfrom(v), vload(s + (j / kgroup) * 16));
        }
    }
};

// The same vectors, widened before into scratch: [width][RB][BITS == 4 ? 2 : 1][16] floats.
template <int BITS, int RB> struct FromScratch {
    const float *w;
    inline void load(int64_t j, int r, V16 &lo, V16 &hi) const {
        const float *at = w + ((j * RB + r) * (BITS == 4 ? 2 : 1)) * 16;
        lo = vload(at);
        if (BITS == 4)
            hi = vload(at + 16);
    }
};

// A dense fp32 operand w (K x N, row-major): input feature j's 16 outputs of block b0 + r are contiguous.
struct FromDense {
    const float *w;
    int64_t N, b0;
    inline void load(int64_t j, int r, V16 &lo, V16 &) const { lo = vload(w + j * N + (b0 + r) * 16); }
};

template <int BITS, int RB, int TB, class Source>
static inline void tile(const float *x, int64_t K, const Source &weights, const float *bias, float *y, int64_t ldy,
                        int64_t b0) {
    const int64_t width = BITS == 4 ? K / 2 : K;
    V16 acc[RB][TB];
    for (int r = 0; r < RB; ++r)
        for (int t = 0; t < TB; ++t)
            acc[r][t] = vzero();
    for (int64_t j = 0; j < width; ++j) {
        V16 lo[RB], hi[RB];
        for (int r = 0; r < RB; ++r)
            weights.load(j, r, lo[r], hi[r]);
        for (int t = 0; t < TB; ++t) {
            V16 a = vset1(x[t * K + j]);
            if (BITS == 4) {
                V16 b = vset1(x[t * K + width + j]);
                for (int r = 0; r < RB; ++r)
                    acc[r][t] = vfmadd(b, hi[r], vfmadd(a, lo[r], acc[r][t]));
            } else {
                for (int r = 0; r < RB; ++r)
                    acc[r][t] = vfmadd(a, lo[r], acc[r][t]);
            }
        }
    }
    for (int r = 0; r < RB; ++r) {
        V16 b = bias ? vload(bias + (b0 + r) * 16) : vzero();
        for (int t = 0; t < TB; ++t)
            vstore(y + t * ldy + (b0 + r) * 16, vadd(acc[r][t], b));
    }
}

template <int BITS, int RB, class Source>
static void token_tiles(const float *x, int64_t T, int64_t K, const Source &weights, const float *bias, float *y,
                        int64_t ldy, int64_t b0) {
    int64_t t0 = 0;
    for (; t0 + TOKENS <= T; t0 += TOKENS)
        tile<BITS, RB, TOKENS>(x + t0 * K, K, weights, bias, y + t0 * ldy, ldy, b0);
    const float *xt = x + t0 * K;
    float *yt = y + t0 * ldy;
    switch (T - t0) { // the last tokens with a tile of exactly their count
    case 1: tile<BITS, RB, 1>(xt, K, weights, bias, yt, ldy, b0); break;
    case 2: tile<BITS, RB, 2>(xt, K, weights, bias, yt, ldy, b0); break;
    case 3: tile<BITS, RB, 3>(xt, K, weights, bias, yt, ldy, b0); break;
    case 4: tile<BITS, RB, 4>(xt, K, weights, bias, yt, ldy, b0); break;
    case 5: tile<BITS, RB, 5>(xt, K, weights, bias, yt, ldy, b0); break;
    default: break;
    }
}

template <int BITS, int RB>
static void row_blocks(const float *x, int64_t T, int64_t K, const uint8_t *codes, const float *scales, int64_t G,
                       int64_t kgroup, const float *bias, float *y, int64_t ldy, int64_t b0) {
    const int64_t width = BITS == 4 ? K / 2 : K;
    const FromCodes<BITS> from_codes{codes, scales, width, G, kgroup, b0};
    if (T < SCRATCH_MIN_TOKENS) { // few token tiles: widen the codes inside each
        token_tiles<BITS, RB>(x, T, K, from_codes, bias, y, ldy, b0);
        return;
    }
    // many token tiles: widen this tile's weights once (RB x 16 rows x K floats: <= 384 KB at K = 1536, in L2) and
    // let every token tile read them, as a GEMM packs its operand
    thread_local std::vector<float> scratch;
    const size_t need = (size_t)width * RB * (BITS == 4 ? 2 : 1) * 16;
    if (scratch.size() < need)
        scratch.resize(need);
    float *w = scratch.data();
    for (int64_t j = 0; j < width; ++j)
        for (int r = 0; r < RB; ++r) {
            V16 lo, hi;
            from_codes.load(j, r, lo, hi);
            float *at = w + ((j * RB + r) * (BITS == 4 ? 2 : 1)) * 16;
            vstore(at, lo);
            if (BITS == 4)
                vstore(at + 16, hi);
        }
    token_tiles<BITS, RB>(x, T, K, FromScratch<BITS, RB>{w}, bias, y, ldy, b0);
}

template <int BITS>
static void product(const float *x, int64_t T, int64_t K, const uint8_t *codes, const float *scales, int64_t G,
                    int64_t kgroup, const float *bias, float *y, int64_t ldy, int64_t first, int64_t last,
                    int threads) {
    // tiles of ROW_BLOCKS blocks split over threads (OpenMP: the process's libgomp.so.1, torch's own pool, so
    // the threads are the ones torch.set_num_threads sets and they do not compete with torch's), then the rest
    const int64_t tiles = (last - first) / ROW_BLOCKS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t q = 0; q < tiles; ++q)
        row_blocks<BITS, ROW_BLOCKS>(x, T, K, codes, scales, G, kgroup, bias, y, ldy, first + q * ROW_BLOCKS);
    for (int64_t b = first + tiles * ROW_BLOCKS; b < last; ++b)
        row_blocks<BITS, 1>(x, T, K, codes, scales, G, kgroup, bias, y, ldy, b);
}

// Row blocks first..last (of 16 rows) of y (T x N, row stride ldy) from x (T x K, contiguous). bias: NULL or N
// floats. threads: how many OpenMP threads share the tiles (1: the calling thread alone).
extern "C" void comera_packed_product(int bits, const float *x, int64_t T, int64_t K, const uint8_t *codes,
                                      const float *scales, int64_t G, int64_t kgroup, const float *bias, float *y,
                                      int64_t ldy, int64_t first, int64_t last, int threads) {
    if (bits == 4)
        product<4>(x, T, K, codes, scales, G, kgroup, bias, y, ldy, first, last, threads);
    else
        product<8>(x, T, K, codes, scales, G, kgroup, bias, y, ldy, first, last, threads);
}

// y (T x N, row stride ldy) = x (T x K, contiguous) w (K x N, row-major, fp32; N a multiple of 16) + bias (NULL
// or N floats): the same tiles over a dense operand, for the skinny products of a PackedTTLinear's dequantized
// cores, where MKL's small-GEMM overheads dominate (a 13 x 384 x 96 product: 17 us).
extern "C" void comera_dense_product(const float *x, int64_t T, int64_t K, const float *w, int64_t N,
                                     const float *bias, float *y, int64_t ldy, int threads) {
    const int64_t blocks = N / 16, tiles = blocks / ROW_BLOCKS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t q = 0; q < tiles; ++q)
        token_tiles<8, ROW_BLOCKS>(x, T, K, FromDense{w, N, q * ROW_BLOCKS}, bias, y, ldy, q * ROW_BLOCKS);
    for (int64_t b = tiles * ROW_BLOCKS; b < blocks; ++b)
        token_tiles<8, 1>(x, T, K, FromDense{w, N, b}, bias, y, ldy, b);
}

// 16 x 16 bytes transposed in registers: four rounds of interleaving row k with row k + 8.
static inline void transpose16(__m128i x[16]) {
    for (int round = 0; round < 4; ++round) {
        __m128i y[16];
        for (int k = 0; k < 8; ++k) {
            y[2 * k] = _mm_unpacklo_epi8(x[k], x[k + 8]);
            y[2 * k + 1] = _mm_unpackhi_epi8(x[k], x[k + 8]);
        }
        for (int k = 0; k < 16; ++k)
            x[k] = y[k];
    }
}

static inline void store16(void *to, __m128i bytes, int bf16) {
    V16 values = vfrom(ifrom_bytes(bytes));
    if (bf16)
        vstore_bf16(to, values);
    else
        vstore((float *)to, values);
}

// Row blocks first..last of the codes as floats in rows (fp32, or bf16 when bf16 != 0) of out (row stride ldo
// elements), the rows of the weight in order: int8 codes as they are; int4 codes times 16 (the byte shifted left
// by 4 is 16 x its low code, the byte with its low bits cleared 16 x its high code: PackedLinear._code_grid's
// values), low codes in columns 0..K/2, high codes in K/2..K; halves = 1 or 2: only the low or only the high
// codes, from column 0. Needs the codes a row to be a multiple of 16.
extern "C" void comera_packed_unpack(int bits, const uint8_t *codes, int64_t K, void *out, int64_t ldo, int bf16,
                                     int64_t first, int64_t last, int halves) {
    const int64_t width = bits == 4 ? K / 2 : K, item = bf16 ? 2 : 4;
    const __m128i high_bits = _mm_set1_epi8((char)0xF0);
    for (int64_t b = first; b < last; ++b) {
        char *rows = (char *)out + (b - first) * 16 * ldo * item;
        for (int64_t j = 0; j < width; j += 16) {
            __m128i x[16];
            for (int k = 0; k < 16; ++k)
                x[k] = _mm_loadu_si128((const __m128i *)(codes + (b * width + j + k) * 16));
            transpose16(x); // x[i]: row i's codes for features j..j+15
            for (int i = 0; i < 16; ++i) {
                char *row = rows + i * ldo * item;
                if (bits == 4) {
                    if (halves != 2)
                        store16(row + j * item, _mm_and_si128(_mm_slli_epi16(x[i], 4), high_bits), bf16);
                    if (halves != 1)
                        store16(row + (j + (halves == 2 ? 0 : width)) * item, _mm_and_si128(x[i], high_bits), bf16);
                } else {
                    store16(row + j * item, x[i], bf16);
                }
            }
        }
    }
}

// count codes in pack()'s stored form (int8, or int4 two to a byte: low nibble first, offset by 8) times their
// scales, one per group of `group` codes, into out (fp32): the dequantized cores of a PackedTTLinear in one pass
// (ATen took four: two nibble masks with strided writes, the offset, the scales). count and group: multiples of 16.
extern "C" void comera_packed_dequantize(int bits, const uint8_t *codes, int64_t count, const float *scales,
                                         int64_t group, float *out) {
    const __m128i low_bits = _mm_set1_epi16(0xF), eight = _mm_set1_epi16(8);
    for (int64_t i = 0; i < count; i += 16) {
        I16 v;
        if (bits == 4) { // codes i .. i+15: bytes i/2 .. i/2+7, each its low code then its high code
            __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(codes + i / 2)));
            __m128i lo = _mm_sub_epi16(_mm_and_si128(bytes, low_bits), eight);
            __m128i hi = _mm_sub_epi16(_mm_srli_epi16(bytes, 4), eight);
            v = ifrom_words(_mm_unpacklo_epi16(lo, hi), _mm_unpackhi_epi16(lo, hi));
        } else {
            v = ifrom_bytes(_mm_loadu_si128((const __m128i *)(codes + i)));
        }
        vstore(out + i, vmul(vfrom(v), vset1(scales[i / group])));
    }
}

extern "C" int comera_packed_abi(void) { return 1; }
