// Linears computed directly on a GGUF file's quantized blocks (Q4_K, Q6_K, Q5_0, Q8_0), AVX2, for
// thinkahead/models/kquant.py: y = x @ W.T + b where W stays in the file's own blocks (memory-mapped,
// never converted) and every row of x is quantized to 8 bits per block, as llama.cpp does it.
//
// Why: a decode step on a CPU is bound by the bytes of weights it streams. The packaged models are
// Q4_K_M files (~4.8 bits per weight); converting them to int8 reads 1.7x the bytes per step.
//
// Numerics, per row of x, independent of every other row (so verification of k drafted tokens
// computes exactly what one-token decoding computes):
// - Q4_K/Q6_K weights (256-value super-blocks) meet x quantized per 256 values (llama.cpp's Q8_K:
//   d = max / -127 with max the value of largest magnitude, q = round_half_even(x / d), and the sums of
//   every 16 q); Q5_0/Q8_0 weights (32-value blocks) meet x quantized per 32 values (d = amax / 127).
// - Each block's dot product is exact integer arithmetic; the float parts (block scales times the
//   integer sums) are accumulated in one fixed order of vector lanes per (row, output), the same code
//   for every row whatever M, the tile or the thread: the result is bit-identical row by row.
// - No fused contraction beyond the explicit _mm256_fmadd_ps (compiled with -ffp-contract=off).
//
// Threads: chunks of output channels of one part, run by parallel.hpp.

#include <pybind11/pybind11.h>

#include "parallel.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

namespace py = pybind11;
using thinkahead_native::as_ptr;

namespace {

#define KQ_FN __attribute__((target("avx2,fma,f16c")))

// ggml's type ids (ggml.h) and block geometry.
enum Type : int { Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
constexpr int64_t QK_K = 256;  // values per super-block (Q4_K, Q6_K)
constexpr int64_t QK = 32;     // values per block (Q5_0, Q8_0)
constexpr int MAX_MR = 4;      // rows of x sharing one unpacked weight block
// Weight rows requested ahead of the one being computed (1.5B layers streamed from memory, 2 threads: no
// prefetch 0.85 ms per 8960x1536 Q4_K layer, 1 row 0.42, 2-4 rows 0.39, 6 rows 0.50).
constexpr int64_t PREFETCH_ROWS = 3;

int64_t block_values(int type) { return type == Q4_K || type == Q6_K ? QK_K : QK; }

int64_t block_bytes(int type) {
    switch (type) {
        case Q4_K: return 144;  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        case Q6_K: return 210;  // 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, fp16 d
        case Q5_0: return 22;   // fp16 d, 32 high bits, 16 bytes of nibbles
        case Q8_0: return 34;   // fp16 d, 32 int8
        default: throw std::invalid_argument("kquant: unsupported ggml type " + std::to_string(type));
    }
}

struct alignas(32) Q8K {  // x per 256 values (aligned: the kernel's 32-byte loads never straddle a line)
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];
    float d;
};

struct alignas(4) Q8B {  // x per 32 values
    int8_t qs[QK];
    float d;
};

KQ_FN inline float fp16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

KQ_FN inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// ---- activation quantization (scalar: a few thousand values per row, next to megabytes of weights) --

void quantize_q8k(const float* x, int64_t K, Q8K* out) {
    for (int64_t b = 0; b < K / QK_K; ++b) {
        const float* v = x + b * QK_K;
        Q8K& q = out[b];
        float amax = 0.0f, mx = 0.0f;
        bool nan = false;
        for (int64_t j = 0; j < QK_K; ++j) {
            nan |= std::isnan(v[j]);
            const float a = std::fabs(v[j]);
            if (a > amax) { amax = a; mx = v[j]; }
        }
        if (nan || amax == 0.0f) {  // NaN anywhere makes the block's outputs NaN, as a float matmul would
            q.d = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
            std::memset(q.qs, 0, sizeof(q.qs));
            std::memset(q.bsums, 0, sizeof(q.bsums));
            continue;
        }
        const float iscale = -127.0f / mx;
        for (int64_t j = 0; j < QK_K; ++j) q.qs[j] = static_cast<int8_t>(std::min(127.0f, std::nearbyint(iscale * v[j])));
        for (int g = 0; g < QK_K / 16; ++g) {
            int sum = 0;
            for (int j = 0; j < 16; ++j) sum += q.qs[16 * g + j];
            q.bsums[g] = static_cast<int16_t>(sum);
        }
        q.d = 1.0f / iscale;
    }
}

void quantize_q8b(const float* x, int64_t K, Q8B* out) {
    for (int64_t b = 0; b < K / QK; ++b) {
        const float* v = x + b * QK;
        Q8B& q = out[b];
        float amax = 0.0f;
        bool nan = false;
        for (int64_t j = 0; j < QK; ++j) {
            nan |= std::isnan(v[j]);
            amax = std::max(amax, std::fabs(v[j]));
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int64_t j = 0; j < QK; ++j) q.qs[j] = nan ? 0 : static_cast<int8_t>(std::nearbyint(v[j] * id));
        q.d = nan ? std::numeric_limits<float>::quiet_NaN() : d;
    }
}

// ---- dot products of one weight row with MR rows of x --------------------------------------------

template <int MR>
KQ_FN void dot_q4k(const uint8_t* w, int64_t nb, const Q8K* const* x, float* res) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MR];
    __m128 acc_m[MR];
    for (int r = 0; r < MR; ++r) { acc[r] = _mm256_setzero_ps(); acc_m[r] = _mm_setzero_ps(); }
    for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = w + i * 144;
        const float wd = fp16(b), wdmin = fp16(b + 2);
        // The 6-bit scales and mins, unpacked with 32-bit masks: bytes 0-7 scales, 8-15 mins (llama.cpp's trick).
        uint32_t u[4];
        std::memcpy(u, b + 4, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
        const uint32_t low_mins = u[1] & 0x3f3f3f3f;
        u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
        u[2] = low_mins;
        u[0] &= 0x3f3f3f3f;
        const __m256i scales_mins = _mm256_cvtepu8_epi16(_mm_set_epi32(static_cast<int>(u[3]), static_cast<int>(u[2]),
                                                                       static_cast<int>(u[1]), static_cast<int>(u[0])));
        const __m128i mins = _mm256_extracti128_si256(scales_mins, 1);
        const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(scales_mins));
        __m256i sumi[MR];
        for (int r = 0; r < MR; ++r) {
            const Q8K& y = x[r][i];
            const __m128i q8s = _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y.bsums)),
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(y.bsums + 8)));
            const __m128i prod = _mm_madd_epi16(mins, q8s);  // sum_j mins[j] * (sum of x in sub-block j)
            acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(-y.d * wdmin), _mm_cvtepi32_ps(prod), acc_m[r]);
            sumi[r] = _mm256_setzero_si256();
        }
        const uint8_t* qs = b + 16;
        for (int j = 0; j < 4; ++j) {
            const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
            const __m256i lo = _mm256_and_si256(bits, m4);                         // values 64 j + l
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);  // values 64 j + 32 + l
            const __m256i sl = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<short>(0x0100 * (4 * j + 1) + 4 * j)));
            const __m256i sh = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<short>(0x0100 * (4 * j + 3) + 4 * j + 2)));
            for (int r = 0; r < MR; ++r) {
                const int8_t* q8 = x[r][i].qs + 64 * j;
                const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8))));
                const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 32))));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
            }
        }
        for (int r = 0; r < MR; ++r)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r][i].d * wd), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    for (int r = 0; r < MR; ++r) {
        __m128 m = _mm_add_ps(acc_m[r], _mm_movehl_ps(acc_m[r], acc_m[r]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        res[r] = hsum8(acc[r]) + _mm_cvtss_f32(m);
    }
}

template <int MR>
KQ_FN void dot_q6k(const uint8_t* w, int64_t nb, const Q8K* const* x, float* res) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = w + i * 210;
        const uint8_t* ql = b;
        const uint8_t* qh = b + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        const float wd = fp16(b + 208);
        const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
        __m256i sumi[MR];
        for (int r = 0; r < MR; ++r) {  // the -32 offset of every value: 32 * sum_g sc[g] * (sum of x in group g)
            const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r][i].bsums));
            sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(bs, scales16), 5));
        }
        for (int j = 0; j < 2; ++j) {
            const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * j));
            const __m256i b2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * j + 32));
            const __m256i bh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * j));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_slli_epi16(_mm256_and_si256(bh, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(b2, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 6), m2), 4));
            for (int t = 0; t < 4; ++t) {  // values 128 j + 32 t + l: scale sc[8 j + 2 t] for l < 16, the next after
                const int g = 8 * j + 2 * t;
                const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
                for (int r = 0; r < MR; ++r) {
                    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r][i].qs + 128 * j + 32 * t));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s, _mm256_maddubs_epi16(q[t], y)));
                }
            }
        }
        for (int r = 0; r < MR; ++r)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r][i].d * wd), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    for (int r = 0; r < MR; ++r) res[r] = hsum8(acc[r]);
}

// 32 signed values of a Q5_0 or Q8_0 block.
template <int TYPE>
KQ_FN inline __m256i block_values32(const uint8_t* b) {
    if constexpr (TYPE == Q8_0) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    } else {  // Q5_0: (nibble | high bit << 4) - 16; element e's high bit is bit e of qh
        const __m128i nib = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
        const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), _mm256_set1_epi8(0x0F));
        uint32_t qh;
        std::memcpy(&qh, b + 2, 4);
        const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
        __m256i bits = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), shuf);
        bits = _mm256_cmpeq_epi8(_mm256_or_si256(bits, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
        return _mm256_or_si256(lo, _mm256_andnot_si256(bits, _mm256_set1_epi8(static_cast<char>(0xF0))));
    }
}

template <int TYPE, int MR>
KQ_FN void dot_q32(const uint8_t* w, int64_t nb, const Q8B* const* x, float* res) {
    constexpr int64_t bytes = TYPE == Q8_0 ? 34 : 22;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = w + i * bytes;
        const float wd = fp16(b);
        const __m256i v = block_values32<TYPE>(b);
        const __m256i av = _mm256_sign_epi8(v, v);  // |w| as unsigned bytes (128 for -128)
        for (int r = 0; r < MR; ++r) {
            const __m256i y = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r][i].qs)), v);
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(av, y), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * x[r][i].d), _mm256_cvtepi32_ps(dot), acc[r]);
        }
    }
    for (int r = 0; r < MR; ++r) res[r] = hsum8(acc[r]);
}

// ---- the parallel loop over output channels -------------------------------------------------------

struct Part {
    int type;
    const uint8_t* w;   // [rows, row_bytes]
    int64_t rows;
    const float* bias;  // [rows] or null
    int64_t offset;     // first output column
};

struct Job {
    std::vector<Part> parts;
    std::vector<int64_t> chunk_part, chunk_first, chunk_last;
    int64_t M = 0, K = 0, N = 0;
    const Q8K* xk = nullptr;  // [M, K / 256], where some part needs it
    const Q8B* xb = nullptr;  // [M, K / 32], where some part needs it
    float* out = nullptr;     // [M, N]
};

template <int MR>
KQ_FN void dot_rows(const Part& part, const uint8_t* w, const Job& job, int64_t m0, float* res) {
    if (part.type == Q4_K || part.type == Q6_K) {
        const int64_t nb = job.K / QK_K;
        const Q8K* x[MR];
        for (int r = 0; r < MR; ++r) x[r] = job.xk + (m0 + r) * nb;
        if (part.type == Q4_K) dot_q4k<MR>(w, nb, x, res);
        else dot_q6k<MR>(w, nb, x, res);
    } else {
        const int64_t nb = job.K / QK;
        const Q8B* x[MR];
        for (int r = 0; r < MR; ++r) x[r] = job.xb + (m0 + r) * nb;
        if (part.type == Q8_0) dot_q32<Q8_0, MR>(w, nb, x, res);
        else dot_q32<Q5_0, MR>(w, nb, x, res);
    }
}

KQ_FN void run_chunk(const void* ctx, int64_t chunk) {
    const Job& job = *static_cast<const Job*>(ctx);
    const Part& part = job.parts[static_cast<size_t>(job.chunk_part[chunk])];
    const int64_t row_bytes = job.K / block_values(part.type) * block_bytes(part.type);
    const int64_t last = job.chunk_last[chunk];
    for (int64_t n = job.chunk_first[chunk]; n < last; ++n) {
        const uint8_t* w = part.w + n * row_bytes;
        // The weights stream from memory once: ask for the row PREFETCH_ROWS ahead while this one computes
        // (the hardware prefetcher alone streams them at less than half the speed).
        if (n + PREFETCH_ROWS < last) {
            const char* ahead = reinterpret_cast<const char*>(w + PREFETCH_ROWS * row_bytes);
            for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        }
        const float bias = part.bias == nullptr ? 0.0f : part.bias[n];
        float res[MAX_MR];
        for (int64_t m = 0; m < job.M; m += MAX_MR) {
            const int64_t rows = std::min<int64_t>(MAX_MR, job.M - m);
            switch (rows) {
                case 4: dot_rows<4>(part, w, job, m, res); break;
                case 3: dot_rows<3>(part, w, job, m, res); break;
                case 2: dot_rows<2>(part, w, job, m, res); break;
                default: dot_rows<1>(part, w, job, m, res); break;
            }
            for (int64_t r = 0; r < rows; ++r) {
                float y = res[r];
                if (part.bias != nullptr) y += bias;
                job.out[(m + r) * job.N + part.offset + n] = y;
            }
        }
    }
}

// out[M, N] = x[M, K] @ W.T (+ bias) for a linear stored in parts: part p holds output columns
// [offset_p, offset_p + rows_p) as a ggml tensor of `types[p]` ([rows_p, K] in its blocks). Pointers are
// data_ptr()s of tensors the caller keeps alive.
void linear(uintptr_t x, int64_t M, int64_t K, const py::list& types, const py::list& weights, const py::list& rows,
            const py::list& biases, uintptr_t out, int threads) {
    const size_t parts = py::len(types);
    if (M < 0 || K <= 0 || parts == 0 || py::len(weights) != parts || py::len(rows) != parts || py::len(biases) != parts)
        throw std::invalid_argument("kquant linear: bad shape or part lists");
    if (!thinkahead_native::avx2_fma_supported()) throw std::runtime_error("kquant linear: this CPU lacks AVX2/FMA");
    Job job;
    job.M = M;
    job.K = K;
    bool need_k = false, need_b = false;
    for (size_t p = 0; p < parts; ++p) {
        Part part{types[p].cast<int>(), as_ptr<const uint8_t>(weights[p].cast<uintptr_t>()), rows[p].cast<int64_t>(),
                  as_ptr<const float>(biases[p].cast<uintptr_t>()), job.N};
        if (K % block_values(part.type) != 0 || part.rows <= 0)
            throw std::invalid_argument("kquant linear: K must be a multiple of the block size, rows > 0");
        (block_values(part.type) == QK_K ? need_k : need_b) = true;
        job.N += part.rows;
        job.parts.push_back(part);
    }
    if (M == 0) return;
    threads = std::max(1, threads);
    // About 8 chunks per thread for balance, 16 to 256 channels each, never across parts.
    const int64_t per_chunk = std::clamp<int64_t>((job.N + 8 * threads - 1) / (8 * threads), 16, 256);
    for (size_t p = 0; p < parts; ++p)
        for (int64_t n = 0; n < job.parts[p].rows; n += per_chunk) {
            job.chunk_part.push_back(static_cast<int64_t>(p));
            job.chunk_first.push_back(n);
            job.chunk_last.push_back(std::min(job.parts[p].rows, n + per_chunk));
        }
    thread_local std::vector<Q8K> xk;
    thread_local std::vector<Q8B> xb;
    const float* xf = as_ptr<const float>(x);
    {
        py::gil_scoped_release release;
        if (need_k) {
            xk.resize(static_cast<size_t>(M * (K / QK_K)));
            for (int64_t m = 0; m < M; ++m) quantize_q8k(xf + m * K, K, xk.data() + m * (K / QK_K));
            job.xk = xk.data();
        }
        if (need_b) {
            xb.resize(static_cast<size_t>(M * (K / QK)));
            for (int64_t m = 0; m < M; ++m) quantize_q8b(xf + m * K, K, xb.data() + m * (K / QK));
            job.xb = xb.data();
        }
        job.out = as_ptr<float>(out);
        thinkahead_native::run_chunks({&run_chunk, &job, static_cast<int64_t>(job.chunk_part.size())}, threads);
    }
}

}  // namespace

PYBIND11_MODULE(_kquant_native, m) {
    m.doc() = "AVX2 linears on GGUF quantized blocks (see thinkahead/models/kquant.py)";
    m.attr("Q5_0") = static_cast<int>(Q5_0);
    m.attr("Q8_0") = static_cast<int>(Q8_0);
    m.attr("Q4_K") = static_cast<int>(Q4_K);
    m.attr("Q6_K") = static_cast<int>(Q6_K);
    m.def("cpu_supported", [] {
        __builtin_cpu_init();
        return thinkahead_native::avx2_fma_supported() && __builtin_cpu_supports("f16c");
    }, "whether this CPU has AVX2, FMA and F16C");
    m.def("block_values", &block_values, py::arg("type"));
    m.def("block_bytes", &block_bytes, py::arg("type"));
    m.def("linear", &linear, py::arg("x"), py::arg("m"), py::arg("k"), py::arg("types"), py::arg("weights"),
          py::arg("rows"), py::arg("biases"), py::arg("out"), py::arg("threads"));
    m.def("threading", &thinkahead_native::threading);
    m.def("set_threading", &thinkahead_native::set_threading, py::arg("mode"));
}
