// An AVX2 int8 linear for RowwiseInt8Linear (thinkahead/models/engine/kernels/quantize.py): y = x @ W.T + b with
// int8 per-output-channel weights and per-row 7-bit activations, bit-identical to PyTorch's fbgemm
// path (quantized::linear_with_input_q_dq_qweight_dq_output_fp32 with scale 2/127, zero point 64,
// then `* row_max` and `+ bias`).
//
// Why: fbgemm needs its weights prepacked at every model load (prepacked weights cannot be cached)
// and reaches only part of the memory bandwidth on one row. Here the weights live in a layout of
// our own (plain int8, memory-mappable, see thinkahead/models/engine/kernels/int8_kernel.py) and each call streams
// them once for all M rows.
//
// Layout: blocks of 32 output channels; within a block, groups of 4 consecutive k; within a group,
// channel-major 4 bytes: byte [(block * Kp/4 + g) * 128 + c * 4 + i] = W[32 * block + c, 4 * g + i]
// (N padded to a multiple of 32, K to a multiple of 4, with zeros).
//
// Numerics (each step is fbgemm's, so the float32 output is the same bit for bit):
// - row_max = max |x| (at least 1e-30); xs = x / row_max (IEEE division, as torch's);
// - q = clamp(round_half_even(fma(xs, 1 / (2/127), 64)), 0, 255) (fbgemm's QuantizeAvx2, LEGACY);
// - acc = sum_k q * w (int32, exact: q <= 128 and |w| <= 127, so vpmaddubsw never saturates);
// - y = float(acc - 64 * colsum(w)) * (x_scale * w_scale[n]) (fbgemm's requantizeForFloatAvx2),
//   then y * row_max, then + bias[n] (two float ops, never fused).
// Integer accumulation is exact whatever the order, and the float epilogue is per element, so a row's
// output never depends on the other rows, on M, on the tiling or on the number of threads.
//
// Threads: chunks of output blocks, run by parallel.hpp (on torch's own OpenMP team where loaded).

#include <pybind11/pybind11.h>

#include "parallel.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t BLOCK_N = 32;  // output channels per block (4 vectors of 8 int32)
constexpr int64_t GROUP_K = 4;   // k per int32 lane
constexpr int64_t BLOCK_BYTES = BLOCK_N * GROUP_K;
constexpr int MAX_MR = 3;        // rows streamed in one tile of 32 channels (3 x 4 accumulators)
constexpr int64_t K_SLICE = 64;  // k groups per slice when several row tiles share a block's weights
constexpr int ZERO_POINT = 64;
constexpr float ROW_MAX_FLOOR = 1e-30f;

#define AVX2_FN __attribute__((target("avx2,fma")))

struct Job {
    const uint8_t* qa;      // [M, Kp] quantized activations
    const float* row_max;   // [M]
    int64_t M;
    int64_t Kp;
    const int8_t* w;        // packed weights
    const int32_t* zp_colsum;  // [Np]: 64 * sum_k W[n, k]
    const float* scale;     // [Np]: x_scale * w_scale[n], in float32
    const float* bias;      // [N] or null
    float* out;             // [M, N]
    int64_t N;
    int64_t blocks;
    int64_t chunk_blocks;
    int64_t chunks;
};

// One block of 32 channels, rows [m0, m0 + MR), k groups [g0, g1): adds the int32 sums into acc (MR x 32,
// row-major; zeroed first when g0 == 0). `ahead`, if not null: the weights to be read next, prefetched
// into L2 at the pace these are read (two cache lines per group).
// JR of the block's 4 vectors of 8 channels, from vector j0.
template <int MR, int JR>
AVX2_FN inline void block_sums(const Job& job, int64_t block, int64_t m0, int j0, int64_t g0, int64_t g1,
                               int32_t* acc_rows, const int8_t* ahead) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[MR][JR];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < JR; ++j)
            acc[r][j] = g0 == 0 ? _mm256_setzero_si256()
                                : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc_rows + r * BLOCK_N + 8 * (j0 + j)));
    const int64_t groups = job.Kp / GROUP_K;
    const int8_t* wb = job.w + block * groups * BLOCK_BYTES;
    const uint8_t* a[MR];
    for (int r = 0; r < MR; ++r) a[r] = job.qa + (m0 + r) * job.Kp;
    for (int64_t g = g0; g < g1; ++g) {
        const __m256i* wp = reinterpret_cast<const __m256i*>(wb + g * BLOCK_BYTES) + j0;
        if (ahead != nullptr) {
            _mm_prefetch(reinterpret_cast<const char*>(ahead + (g - g0) * BLOCK_BYTES), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(ahead + (g - g0) * BLOCK_BYTES + 64), _MM_HINT_T1);
        }
        __m256i w[JR];
        for (int j = 0; j < JR; ++j) w[j] = _mm256_loadu_si256(wp + j);
        for (int r = 0; r < MR; ++r) {
            int32_t four;
            std::memcpy(&four, a[r] + g * GROUP_K, sizeof(four));
            const __m256i av = _mm256_set1_epi32(four);
            for (int j = 0; j < JR; ++j)
                acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(av, w[j]), ones));
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < JR; ++j)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc_rows + r * BLOCK_N + 8 * (j0 + j)), acc[r][j]);
}

// The float epilogue of one block for every row, from its int32 sums (M x 32).
AVX2_FN void block_epilogue(const Job& job, int64_t block, const int32_t* acc) {
    const int64_t n0 = block * BLOCK_N;
    const int64_t valid = std::min<int64_t>(BLOCK_N, job.N - n0);
    alignas(32) float bias_tail[BLOCK_N] = {};  // the bias is not padded: the last block reads a copy
    const float* bias = job.bias == nullptr ? nullptr : job.bias + n0;
    if (bias != nullptr && valid < BLOCK_N) {
        std::memcpy(bias_tail, bias, valid * sizeof(float));
        bias = bias_tail;
    }
    for (int64_t m = 0; m < job.M; ++m) {
        const __m256 rm = _mm256_set1_ps(job.row_max[m]);
        alignas(32) float tmp[BLOCK_N];
        float* dst = valid == BLOCK_N ? job.out + m * job.N + n0 : tmp;
        for (int j = 0; j < 4; ++j) {
            const int64_t n = n0 + 8 * j;
            const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + m * BLOCK_N + 8 * j));
            const __m256i zc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(job.zp_colsum + n));
            __m256 y = _mm256_cvtepi32_ps(_mm256_sub_epi32(sums, zc));
            y = _mm256_mul_ps(y, _mm256_loadu_ps(job.scale + n));
            y = _mm256_mul_ps(y, rm);
            if (bias != nullptr) y = _mm256_add_ps(y, _mm256_loadu_ps(bias + 8 * j));
            _mm256_storeu_ps(dst + 8 * j, y);
        }
        if (dst == tmp) std::memcpy(job.out + m * job.N + n0, tmp, valid * sizeof(float));
    }
}

// Every row of the chunk's blocks. Up to 3 rows: one register tile of MR rows x 32 channels streams
// each block once. More rows: tiles of 4 rows x 16 channels (8 accumulators, no spills), and K walked
// in slices of K_SLICE groups (8 KB of a block's weights) that every row tile then reads from L1.
AVX2_FN void run_chunk(const Job& job, int64_t chunk) {
    thread_local std::vector<int32_t> acc;
    acc.resize(static_cast<size_t>(job.M * BLOCK_N));
    int32_t* sums = acc.data();
    const int64_t groups = job.Kp / GROUP_K;
    const int64_t block_bytes = groups * BLOCK_BYTES;
    const int64_t first = chunk * job.chunk_blocks;
    const int64_t last = std::min(job.blocks, first + job.chunk_blocks);
    for (int64_t block = first; block < last; ++block) {
        const int8_t* next_block = block + 1 < job.blocks ? job.w + (block + 1) * block_bytes : nullptr;
        if (job.M <= MAX_MR) {
            if (job.M == 3) block_sums<3, 4>(job, block, 0, 0, 0, groups, sums, next_block);
            else if (job.M == 2) block_sums<2, 4>(job, block, 0, 0, 0, groups, sums, next_block);
            else block_sums<1, 4>(job, block, 0, 0, 0, groups, sums, next_block);
        } else {
            for (int64_t g0 = 0; g0 < groups; g0 += K_SLICE) {
                const int64_t g1 = std::min(groups, g0 + K_SLICE);
                // The first row tile prefetches what follows: the next slice, else the next block's start.
                const int8_t* ahead = g1 < groups ? job.w + block * block_bytes + g1 * BLOCK_BYTES : next_block;
                for (int j0 = 0; j0 < 4; j0 += 2) {
                    int64_t m = 0;
                    for (; m + 4 <= job.M; m += 4, ahead = nullptr)
                        block_sums<4, 2>(job, block, m, j0, g0, g1, sums + m * BLOCK_N, ahead);
                    switch (job.M - m) {
                        case 3: block_sums<3, 2>(job, block, m, j0, g0, g1, sums + m * BLOCK_N, ahead); break;
                        case 2: block_sums<2, 2>(job, block, m, j0, g0, g1, sums + m * BLOCK_N, ahead); break;
                        case 1: block_sums<1, 2>(job, block, m, j0, g0, g1, sums + m * BLOCK_N, ahead); break;
                        default: break;
                    }
                    ahead = nullptr;
                }
            }
        }
        block_epilogue(job, block, sums);
    }
}

// Row scaling and fbgemm's activation quantization; pads [K, Kp) with zeros.
AVX2_FN void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, float x_inv_scale, uint8_t* qa,
                           float* row_max) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 inv_v = _mm256_set1_ps(x_inv_scale);
    const __m256 zp_v = _mm256_set1_ps(static_cast<float>(ZERO_POINT));
    const __m256i lo = _mm256_setzero_si256();
    const __m256i hi = _mm256_set1_epi32(255);
    for (int64_t m = 0; m < M; ++m) {
        const float* row = x + m * K;
        __m256 mx = _mm256_setzero_ps();
        __m256 nan = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256 v = _mm256_loadu_ps(row + k);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mx);
        float rmax = 0.0f;
        for (float lane : lanes) rmax = std::max(rmax, lane);
        bool has_nan = _mm256_movemask_ps(nan) != 0;
        for (; k < K; ++k) {
            has_nan |= std::isnan(row[k]);
            rmax = std::max(rmax, std::fabs(row[k]));
        }
        if (has_nan) rmax = std::numeric_limits<float>::quiet_NaN();  // as torch's amax
        else rmax = std::max(rmax, ROW_MAX_FLOOR);
        row_max[m] = rmax;
        const __m256 rm_v = _mm256_set1_ps(rmax);
        uint8_t* q = qa + m * Kp;
        k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256 xs = _mm256_div_ps(_mm256_loadu_ps(row + k), rm_v);
            __m256i v = _mm256_cvtps_epi32(_mm256_fmadd_ps(xs, inv_v, zp_v));
            v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
            alignas(32) int32_t ints[8];
            _mm256_store_si256(reinterpret_cast<__m256i*>(ints), v);
            for (int i = 0; i < 8; ++i) q[k + i] = static_cast<uint8_t>(ints[i]);
        }
        for (; k < K; ++k) {
            const float t = std::fma(row[k] / rmax, x_inv_scale, static_cast<float>(ZERO_POINT));
            float r = std::nearbyint(t);  // ties to even, as vcvtps2dq under the default rounding mode
            r = std::isnan(r) ? 0.0f : std::min(255.0f, std::max(0.0f, r));
            q[k] = static_cast<uint8_t>(r);
        }
        std::memset(q + K, 0, Kp - K);
    }
}

void run_chunk_task(const void* ctx, int64_t chunk) { run_chunk(*static_cast<const Job*>(ctx), chunk); }

bool cpu_supported() { return thinkahead_native::avx2_fma_supported(); }

using thinkahead_native::as_ptr;

// out[M, N] = the int8 linear of x[M, K] (float32, contiguous). Pointers are data_ptr()s of tensors the
// caller keeps alive; packed, zp_colsum and scale cover Np = N rounded up to 32 (see the layout above),
// bias (0: none) covers N.
void linear(uintptr_t x, int64_t M, int64_t K, uintptr_t packed, uintptr_t zp_colsum, uintptr_t scale,
            uintptr_t bias, uintptr_t out, int64_t N, double x_scale, int threads) {
    if (M < 0 || K <= 0 || N <= 0) throw std::invalid_argument("int8 linear: bad shape");
    if (!cpu_supported()) throw std::runtime_error("int8 linear: this CPU lacks AVX2/FMA");
    if (M == 0) return;
    const int64_t Kp = (K + GROUP_K - 1) / GROUP_K * GROUP_K;
    thread_local std::vector<uint8_t> qa;
    thread_local std::vector<float> row_max;
    qa.resize(static_cast<size_t>(M * Kp));
    row_max.resize(static_cast<size_t>(M));
    const float x_scale_f = static_cast<float>(x_scale);
    quantize_rows(as_ptr<const float>(x), M, K, Kp, 1.0f / x_scale_f, qa.data(), row_max.data());
    Job job{};
    job.qa = qa.data();
    job.row_max = row_max.data();
    job.M = M;
    job.Kp = Kp;
    job.w = as_ptr<const int8_t>(packed);
    job.zp_colsum = as_ptr<const int32_t>(zp_colsum);
    job.scale = as_ptr<const float>(scale);
    job.bias = bias ? as_ptr<const float>(bias) : nullptr;
    job.out = as_ptr<float>(out);
    job.N = N;
    job.blocks = (N + BLOCK_N - 1) / BLOCK_N;
    threads = std::max(1, threads);
    // About 8 chunks per thread (dynamic balance), at most 64 blocks (2048 channels) each.
    job.chunk_blocks = std::clamp<int64_t>((job.blocks + 8 * threads - 1) / (8 * threads), 1, 64);
    job.chunks = (job.blocks + job.chunk_blocks - 1) / job.chunk_blocks;
    thinkahead_native::run_chunks({&run_chunk_task, &job, job.chunks}, threads);
}

// The layout above from plain int8 weights [N, K] (row-major), and 64 * each row's sum.
void pack_weights(uintptr_t src, int64_t N, int64_t K, uintptr_t dst, uintptr_t zp_colsum) {
    const int8_t* w = as_ptr<const int8_t>(src);
    int8_t* out = as_ptr<int8_t>(dst);
    int32_t* colsum = as_ptr<int32_t>(zp_colsum);
    const int64_t Kp = (K + GROUP_K - 1) / GROUP_K * GROUP_K;
    const int64_t groups = Kp / GROUP_K;
    const int64_t Np = (N + BLOCK_N - 1) / BLOCK_N * BLOCK_N;
    for (int64_t n = 0; n < Np; ++n) {
        const int64_t block = n / BLOCK_N, c = n % BLOCK_N;
        int8_t* base = out + block * groups * BLOCK_BYTES + c * GROUP_K;
        int32_t sum = 0;
        for (int64_t g = 0; g < groups; ++g) {
            for (int64_t i = 0; i < GROUP_K; ++i) {
                const int64_t k = g * GROUP_K + i;
                const int8_t v = (n < N && k < K) ? w[n * K + k] : 0;
                base[g * BLOCK_BYTES + i] = v;
                sum += v;
            }
        }
        colsum[n] = ZERO_POINT * sum;
    }
}

// Plain int8 weights [N, K] back from the layout.
void unpack_weights(uintptr_t src, int64_t N, int64_t K, uintptr_t dst) {
    const int8_t* in = as_ptr<const int8_t>(src);
    int8_t* w = as_ptr<int8_t>(dst);
    const int64_t groups = (K + GROUP_K - 1) / GROUP_K;
    for (int64_t n = 0; n < N; ++n) {
        const int8_t* base = in + (n / BLOCK_N) * groups * BLOCK_BYTES + (n % BLOCK_N) * GROUP_K;
        for (int64_t k = 0; k < K; ++k) w[n * K + k] = base[(k / GROUP_K) * BLOCK_BYTES + k % GROUP_K];
    }
}

}  // namespace

PYBIND11_MODULE(_int8_native, m) {
    m.doc() = "AVX2 int8 linear for RowwiseInt8Linear (see thinkahead/models/engine/kernels/int8_kernel.py)";
    m.attr("BLOCK_N") = BLOCK_N;
    m.attr("GROUP_K") = GROUP_K;
    m.attr("ZERO_POINT") = ZERO_POINT;
    m.def("cpu_supported", &cpu_supported, "whether this CPU has AVX2 and FMA");
    m.def("linear", &linear, py::arg("x"), py::arg("m"), py::arg("k"), py::arg("packed"), py::arg("zp_colsum"),
          py::arg("scale"), py::arg("bias"), py::arg("out"), py::arg("n"), py::arg("x_scale"), py::arg("threads"),
          py::call_guard<py::gil_scoped_release>());
    m.def("threading", &thinkahead_native::threading, "which threads run the chunks: torch's OpenMP team or our pool");
    m.def("set_threading", &thinkahead_native::set_threading, py::arg("mode"), "openmp (where torch's libgomp is loaded) or pool");
    m.def("pack_weights", &pack_weights, py::arg("src"), py::arg("n"), py::arg("k"), py::arg("dst"),
          py::arg("zp_colsum"), py::call_guard<py::gil_scoped_release>());
    m.def("unpack_weights", &unpack_weights, py::arg("src"), py::arg("n"), py::arg("k"), py::arg("dst"),
          py::call_guard<py::gil_scoped_release>());
}
