// Linears computed directly on a GGUF file's quantized blocks (Q4_K, Q6_K, Q4_0, Q5_0, Q8_0), AVX2/AVX-VNNI, for
// thinkahead/models/engine/kernels/kquant.py: y = x @ W.T + b where W stays in the file's blocks (never converted;
// its blocks rearranged once at load into the kernel's layout: kquant_layout.inc) and every row of
// x is quantized to 8 bits per block, as llama.cpp does it.
//
// Why: a decode step on a CPU is bound by the bytes of weights it streams. The packaged models are
// Q4_K_M files (~4.8 bits per weight); converting them to int8 reads 1.7x the bytes per step.
//
// Numerics, per row of x, independent of every other row (so verification of k drafted tokens
// computes exactly what one-token decoding computes):
// - Q4_K/Q6_K weights (256-value super-blocks) meet x quantized per 256 values (llama.cpp's Q8_K:
//   d = max / -127 with max the value of largest magnitude, q = round_half_even(x / d), and the sums of
//   every 16 q); Q4_0/Q5_0/Q8_0 weights (32-value blocks) meet x quantized per 32 values (d = amax / 127).
// - Each block's dot product is exact integer arithmetic. Q4_K/Q6_K: per super-block, two exact
//   integers (the scaled dot product, the mins term) meet the float scales in one fixed formula and
//   order (kquant_dots.inc's epilogue), whichever path computed them: row by row (kquant_dots.inc),
//   several rows per vector (the same), or tiles of 8 rows in the vector lanes (kquant_tiles.inc, from
//   12 or 16 rows of x on, AVX-VNNI; 16 rows from 9 on in the 512-bit build; Q4_K on AMX from 24: kquant_amx.inc). Q4_0/Q5_0/Q8_0: per block, its integer dot product's 8 lanes times the block
//   scales' product (w.d * x.d), accumulated lane by lane in block order, the lanes summed last. Either way
//   the result is bit-identical row by row, whatever M, the path or the thread.
// - No fused contraction beyond the explicit fmadd (compiled with -ffp-contract=off).
//
// Threads: chunks of output channels of one part, run by parallel.hpp.

#include <pybind11/pybind11.h>

#include "parallel.hpp"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <stdexcept>
#include <vector>

namespace py = pybind11;
using thinkahead_native::as_ptr;

namespace {


// ggml's type ids (ggml.h) and block geometry.
enum Type : int { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
constexpr int64_t QK_K = 256;  // values per super-block (Q4_K, Q6_K)
constexpr int64_t QK = 32;     // values per block (Q4_0, Q5_0, Q8_0)
// Rows of x sharing one unpacked weight block: 8 in the AVX-512 build (32 registers; 1.5B verify of 5-12
// tokens 0.86-0.92x the time of passes of 4), 4 in the others (16 registers: 8 rows' sums would spill).
constexpr int MAX_MR = 8;
// Weight rows requested ahead of the one being computed (1.5B layers streamed from memory, 2 threads: no
// prefetch 0.85 ms per 8960x1536 Q4_K layer, 1 row 0.42, 2-4 rows 0.39, 6 rows 0.50).
constexpr int64_t PREFETCH_ROWS = 3;

int64_t block_values(int type) {
    if (type == Q4_K || type == Q6_K) return QK_K;
    if (type == Q4_0 || type == Q5_0 || type == Q8_0) return QK;
    throw std::invalid_argument("kquant: unsupported ggml type " + std::to_string(type));
}

int64_t block_bytes(int type) {
    switch (type) {
        case Q4_K: return 144;  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        case Q6_K: return 210;  // 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, fp16 d
        case Q4_0: return 18;   // fp16 d, 16 bytes of nibbles
        case Q5_0: return 22;   // fp16 d, 32 high bits, 16 bytes of nibbles
        case Q8_0: return 34;   // fp16 d, 32 int8
        default: throw std::invalid_argument("kquant: unsupported ggml type " + std::to_string(type));
    }
}

struct alignas(64) Q8K {  // x per 256 values (aligned: the kernel's 32- and 64-byte loads never straddle a line)
    int8_t qs[QK_K];           // in the kernel layout (kquant_layout.inc)
    int16_t bsums[QK_K / 16];  // sums of 16 codes: groups 0, 2, .., 14, then 1, 3, .., 15
    int16_t sums32[QK_K / 32]; // sums of 32 codes (groups 2 s and 2 s + 1): what Q4_K's mins multiply
    float d;
};

struct alignas(32) Q8B {  // x per 32 values: the codes (the scales in an array of their own: Job::xbd)
    int8_t qs[QK];
};

#include "kquant_layout.inc"
#include "kquant_rows.inc"
#include "kquant_zmm_probe.inc"

#include "kquant_quantize.inc"

// ---- the parallel loop over output channels -------------------------------------------------------

struct Part {
    int type;
    const uint8_t* w;   // [rows, row_bytes]
    int64_t rows;
    const float* bias;  // [rows] or null
    int64_t offset;     // first output column
};

// Builds of the dot products, by preference (AVX512_ZMM where this CPU's 512-bit multiplies pay: zmm_pays;
// AVX512_AMX: AVX512_ZMM with its tiles on AMX, where the CPU has it and Linux grants it: kquant_amx.inc).
enum Isa : int { AVX2 = 0, AVX_VNNI = 1, AVX512_VNNI = 2, AVX512_ZMM = 3, AVX512_AMX = 4 };
constexpr int64_t rows_per_pass(int isa) { return isa >= AVX512_VNNI ? MAX_MR : 4; }  // see MAX_MR
constexpr int64_t tile_width(int isa) { return isa >= AVX512_ZMM ? TILE16 : TILE; }  // rows of x per tile
const char* const ISA_NAMES[] = {"avx2", "avxvnni", "avx512vnni", "avx512vnni-zmm", "avx512vnni-amx"};

struct Job {
    std::vector<Part> parts;
    std::vector<int64_t> chunk_part, chunk_first, chunk_last;
    int64_t M = 0, K = 0, N = 0;
    const Q8K* xk = nullptr;  // [M, K / 256], where some part needs it
    const Q8B* xb = nullptr;  // [M, K / 32], where some part needs it
    const float* xbd = nullptr;  // [M, K / 32 + GROUP]: xb's scales (a row's last group may read past its end)
    float* out = nullptr;     // [M, N]
    int isa = AVX2;           // which build of the dot products runs (the same results; fewer instructions)
    const void* xt = nullptr;   // x's first `tiled` rows in XTileW<tile_width(isa)> [ceil(tiled / width)][K / 256]
    int64_t tiled = 0;        // rows of x the K-quant parts compute in tiles (the last may be partial; 0: none)
};

// Output channel n of x's rows m .. m + rows - 1: their sums, plus the channel's bias where the part has one.
inline void put_column(const Part& part, const Job& job, int64_t n, int64_t m, int64_t rows, const float* sums) {
    const float bias = part.bias == nullptr ? 0.0f : part.bias[n];
    for (int64_t r = 0; r < rows; ++r) {
        float y = sums[r];
        if (part.bias != nullptr) y += bias;
        job.out[(m + r) * job.N + part.offset + n] = y;
    }
}

// ---- the dot products, compiled for each ISA (kquant_dots.inc) ------------------------------------

#define KQ_ZMM 0  // the 256-bit builds
namespace isa_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define KQ_VNNI 0
#include "kquant_dots.inc"
#undef KQ_VNNI
#pragma GCC pop_options
}  // namespace isa_avx2

namespace isa_vnni {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define KQ_VNNI 1
#include "kquant_dots.inc"
#include "kquant_tiles.inc"
#undef KQ_DPBUSD
#undef KQ_DPWSSD
#undef KQ_VNNI
#pragma GCC pop_options
}  // namespace isa_vnni

namespace isa_avx512 {  // 256-bit vectors (512-bit multiplies issue on one port on some CPUs), EVEX's 32 registers
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#define KQ_VNNI 2
#include "kquant_dots.inc"
#include "kquant_tiles.inc"
#undef KQ_DPBUSD
#undef KQ_DPWSSD
#undef KQ_VNNI
#pragma GCC pop_options
}  // namespace isa_avx512
#undef KQ_ZMM

namespace isa_zmm {  // isa_avx512 with the Q4_K/Q6_K products in 512-bit vectors, and tiles of 16 rows of x
#pragma GCC push_options
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own _mm512_undefined_* in its 512-bit headers
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#define KQ_VNNI 2
#define KQ_ZMM 1
#include "kquant_dots.inc"
#include "kquant_tiles.inc"
#include "kquant_amx.inc"
#undef KQ_DPBUSD
#undef KQ_DPWSSD
#undef KQ_ZMM
#undef KQ_VNNI
#pragma GCC diagnostic pop
#pragma GCC pop_options
}  // namespace isa_zmm

template <int MR>
void dot_rows(const Part& part, const uint8_t* w, const Job& job, int64_t m, float* res) {
    switch (job.isa) {
        case AVX512_AMX:
        case AVX512_ZMM: isa_zmm::dot_rows<MR>(part, w, job, m, res); break;
        case AVX512_VNNI: isa_avx512::dot_rows<MR>(part, w, job, m, res); break;
        case AVX_VNNI: isa_vnni::dot_rows<MR>(part, w, job, m, res); break;
        default: isa_avx2::dot_rows<MR>(part, w, job, m, res); break;
    }
}

template <int TYPE>
void tiled_rows(const Part& part, const Job& job, int64_t first, int64_t last, int64_t row_bytes) {
    if (job.isa == AVX512_AMX && TYPE == Q4_K && job.tiled >= isa_zmm::AMX_FROM_ROWS)
        isa_zmm::amx_rows(part, job, first, last, row_bytes);
    else if (job.isa >= AVX512_ZMM) isa_zmm::tiled_rows<TYPE>(part, job, first, last, row_bytes);
    else if (job.isa == AVX512_VNNI) isa_avx512::tiled_rows<TYPE>(part, job, first, last, row_bytes);
    else isa_vnni::tiled_rows<TYPE>(part, job, first, last, row_bytes);
}

#include "kquant_spans.inc"

void run_chunk(const void* ctx, int64_t chunk) {
    const Job& job = *static_cast<const Job*>(ctx);
    const Part& part = job.parts[static_cast<size_t>(job.chunk_part[chunk])];
    const int64_t row_bytes = job.K / block_values(part.type) * block_bytes(part.type);
    const int64_t last = job.chunk_last[chunk];
    const bool kquant = part.type == Q4_K || part.type == Q6_K;
    const int64_t m_first = kquant ? job.tiled : 0;  // rows before it: in tiles
    if (kquant && job.tiled > 0) {
        if (part.type == Q4_K) tiled_rows<Q4_K>(part, job, job.chunk_first[chunk], last, row_bytes);
        else tiled_rows<Q6_K>(part, job, job.chunk_first[chunk], last, row_bytes);
        if (m_first == job.M) return;
    }
    if (job.isa >= AVX512_ZMM && kquant && job.M - m_first >= 2 && job.M - m_first <= MAX_MR && job.K / QK_K >= SPAN_FROM_BLOCKS) {
        spanned_rows(part, job, job.chunk_first[chunk], last, row_bytes, m_first);
        return;
    }
    for (int64_t n = job.chunk_first[chunk]; n < last; ++n) {
        const uint8_t* w = part.w + n * row_bytes;
        // The weights stream from memory once: ask for the row PREFETCH_ROWS ahead while this one computes
        // (the hardware prefetcher alone streams them at less than half the speed).
        if (n + PREFETCH_ROWS < last) {
            const char* ahead = reinterpret_cast<const char*>(w + PREFETCH_ROWS * row_bytes);
            for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        }
        float res[MAX_MR];
        const int64_t pass = rows_per_pass(job.isa);
        for (int64_t m = m_first; m < job.M; m += pass) {
            const int64_t rows = std::min<int64_t>(pass, job.M - m);
            switch (rows) {
                case 8: dot_rows<8>(part, w, job, m, res); break;
                case 7: dot_rows<7>(part, w, job, m, res); break;
                case 6: dot_rows<6>(part, w, job, m, res); break;
                case 5: dot_rows<5>(part, w, job, m, res); break;
                case 4: dot_rows<4>(part, w, job, m, res); break;
                case 3: dot_rows<3>(part, w, job, m, res); break;
                case 2: dot_rows<2>(part, w, job, m, res); break;
                default: dot_rows<1>(part, w, job, m, res); break;
            }
            put_column(part, job, n, m, rows, res);
        }
    }
}

bool isa_supported(int which) {
    __builtin_cpu_init();
    if (which >= AVX512_VNNI)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni") &&
               (which != AVX512_AMX || isa_zmm::amx_usable());
    return which == AVX2 || (which == AVX_VNNI && __builtin_cpu_supports("avxvnni"));
}

int best_isa() {
    static const int best = [] {
        if (isa_supported(AVX512_AMX)) return static_cast<int>(AVX512_AMX);
        for (int which = AVX512_VNNI; which > AVX2; --which)
            if (isa_supported(which)) return which == AVX512_VNNI && zmm_pays() ? AVX512_ZMM : which;
        return static_cast<int>(AVX2);
    }();
    return best;
}

std::atomic<int> chosen_isa{-1};  // -1: the best this CPU runs; set_isa (tests, benches)
// Rows of x from which the K-quant parts run in tiles of 8 or 16 (the same bits as row by row). Below them the
// row-by-row path is as fast or faster. Measured on the 1.5B's linears (AMD Zen 5, 2 threads) once the tiles
// prefetched their next weight rows block by block (kquant_tiles.inc): tiles of 16 rows (AVX512_ZMM) cost about
// the same from 2 to 16 rows (70-76 ms), passes of 8 rows 62 ms at 8 rows, 80 at 10, 90 at 12, so from 10 rows;
// tiles of 8 with 8-row passes (AVX-512 VNNI in 256-bit vectors) 111 against 122 ms at 16 rows, 101 against 93
// at 12, so from 16; tiles of 8 with 4-row passes (AVX-VNNI) 108 against 112 ms at 12 rows, 70 against 72 at 8,
// so from 12. Once the tiles asked for the next pass's weights while multiplying (not while unpacking), 1.5B whole
// forwards of 9 rows took 62-63 ms in a tile against 69 row by row: tiles of 16 from 9.
constexpr int64_t TILE_FROM_ROWS_4 = 12, TILE_FROM_ROWS_8 = 16, TILE_FROM_ROWS_16 = 9;
constexpr int64_t TILE_FROM_AUTO = -1;
std::atomic<int64_t> tile_from{TILE_FROM_AUTO};  // set_tile_from (tests, benches); 0: never; -1: by the ISA
// Rows past the last full tile that go in a partial tile (fewer run row by row). Tiles of 8: 1.5B verify of 20
// rows, 4 in a partial tile 1.03x slower, 21: 5 in one 0.95x. Tiles of 16: 1.5B linears, 20 rows 107 ms with 4
// row by row, 116 in a tile; 24 rows 131 ms with 8 row by row, 118 in a tile.
constexpr int64_t TILE_PARTIAL_ROWS = 5, TILE16_PARTIAL_ROWS = 6;

int current_isa() {
    const int which = chosen_isa.load();
    return which < 0 ? best_isa() : which;
}

std::string isa() { return ISA_NAMES[current_isa()]; }

void set_isa(const std::string& name) {
    for (int which = AVX2; which <= AVX512_AMX; ++which) {
        if (name != ISA_NAMES[which]) continue;
        if (!isa_supported(which)) throw std::invalid_argument("isa: this CPU lacks " + name);
        chosen_isa.store(which);
        return;
    }
    throw std::invalid_argument("isa: avx2, avxvnni, avx512vnni, avx512vnni-zmm or avx512vnni-amx");
}

// x's first `rows` rows (Q8K [rows][nb]) in tiles of W, in this thread's scratch (valid until its next call).
template <int W>
const void* job_tiles(const Q8K* x, int64_t rows, int64_t nb) {
    thread_local std::vector<XTileW<W>> tiles;
    tiles.resize(static_cast<size_t>((rows + W - 1) / W * nb));
    make_tiles(x, rows, nb, tiles.data());
    return tiles.data();
}

// out[M, N] = x[M, K] @ W.T (+ bias) for a linear stored in parts: part p holds output columns
// [offset_p, offset_p + rows_p) as a ggml tensor of `types[p]` ([rows_p, K] in its blocks), bias[p] null or
// its rows_p biases. Pointers address tensors the caller keeps alive. No Python: runs without the GIL.
void linear_parts(const float* xf, int64_t M, int64_t K, const int* types, const uint8_t* const* weights,
                  const int64_t* rows, const float* const* biases, size_t parts, float* out, int threads) {
    if (M < 0 || K <= 0 || parts == 0) throw std::invalid_argument("kquant linear: bad shape or part lists");
    if (!thinkahead_native::avx2_fma_supported()) throw std::runtime_error("kquant linear: this CPU lacks AVX2/FMA");
    Job job;
    job.isa = current_isa();
    job.M = M;
    job.K = K;
    bool need_k = false, need_b = false;
    for (size_t p = 0; p < parts; ++p) {
        Part part{types[p], weights[p], rows[p], biases[p], job.N};
        block_bytes(part.type);  // throws for an unknown type here, not inside the parallel region
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
    thread_local std::vector<float> xbd;
    if (need_k) {
        xk.resize(static_cast<size_t>(M * (K / QK_K)));
        for (int64_t m = 0; m < M; ++m) quantize_q8k(xf + m * K, K, xk.data() + m * (K / QK_K));
        job.xk = xk.data();
        const int64_t set = tile_from.load(), width = tile_width(job.isa);
        const int64_t from = set != TILE_FROM_AUTO       ? set
                             : width == TILE16            ? TILE_FROM_ROWS_16
                             : rows_per_pass(job.isa) == 8 ? TILE_FROM_ROWS_8
                                                           : TILE_FROM_ROWS_4;
        if (job.isa != AVX2 && from > 0 && M >= from) {
            // Rows left over past the last full tile: a partial tile from a share of a tile on (see
            // TILE_PARTIAL_ROWS), else row by row (a row costs about a quarter of a tile's instructions).
            const int64_t partial = width == TILE16 ? TILE16_PARTIAL_ROWS : TILE_PARTIAL_ROWS;
            job.tiled = M % width >= partial || M < width ? M : M / width * width;
            job.xt = width == TILE16 ? job_tiles<TILE16>(xk.data(), job.tiled, K / QK_K)
                                     : job_tiles<TILE>(xk.data(), job.tiled, K / QK_K);
        }
    }
    if (need_b) {
        const int64_t nb = K / QK;
        xb.resize(static_cast<size_t>(M * nb));
        xbd.assign(static_cast<size_t>(M * nb + GROUP), 0.0f);
        for (int64_t m = 0; m < M; ++m) quantize_q8b(xf + m * K, K, xb.data() + m * nb, xbd.data() + m * nb);
        job.xb = xb.data();
        job.xbd = xbd.data();
    }
    job.out = out;
    thinkahead_native::run_chunks({&run_chunk, &job, static_cast<int64_t>(job.chunk_part.size())}, threads);
}

void linear(uintptr_t x, int64_t M, int64_t K, const py::list& types, const py::list& weights, const py::list& rows,
            const py::list& biases, uintptr_t out, int threads) {
    const size_t parts = py::len(types);
    if (py::len(weights) != parts || py::len(rows) != parts || py::len(biases) != parts)
        throw std::invalid_argument("kquant linear: bad shape or part lists");
    std::vector<int> t(parts);
    std::vector<const uint8_t*> w(parts);
    std::vector<int64_t> r(parts);
    std::vector<const float*> b(parts);
    for (size_t p = 0; p < parts; ++p) {
        t[p] = types[p].cast<int>();
        w[p] = as_ptr<const uint8_t>(weights[p].cast<uintptr_t>());
        r[p] = rows[p].cast<int64_t>();
        b[p] = as_ptr<const float>(biases[p].cast<uintptr_t>());
    }
    py::gil_scoped_release release;
    linear_parts(as_ptr<const float>(x), M, K, t.data(), w.data(), r.data(), b.data(), parts, as_ptr<float>(out), threads);
}

// Rewrites a [rows, cols] tensor's blocks from the file's layout into the kernel's (kquant_layout.inc);
// src == dst rewrites them in place.
void repack(int type, uintptr_t src, uintptr_t dst, int64_t rows, int64_t cols) {
    const int64_t bytes = block_bytes(type), values = block_values(type);
    if (rows < 0 || cols <= 0 || cols % values != 0)
        throw std::invalid_argument("kquant repack: rows >= 0 and columns a positive multiple of the block size");
    if (!thinkahead_native::avx2_fma_supported()) throw std::runtime_error("kquant repack: this CPU lacks AVX2/FMA");
    const uint8_t* in = as_ptr<const uint8_t>(src);
    uint8_t* out = as_ptr<uint8_t>(dst);
    const int64_t nb = cols / values;
    py::gil_scoped_release release;
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* row_in = in + r * nb * bytes;
        uint8_t* row_out = out + r * nb * bytes;
        if (block_values(type) == QK) {
            repack_q32_row(type, row_in, row_out, nb);
            continue;
        }
        for (int64_t b = 0; b < nb; ++b) {
            if (type == Q4_K) repack_q4k_block(row_in + b * bytes, row_out + b * bytes);
            else repack_q6k_block(row_in + b * bytes, row_out + b * bytes);
        }
    }
}

}  // namespace

// linear_parts for another extension, by address (`linear_address`): 0, or 1 with the error's message in
// `error` (never an exception across the modules' boundary).
extern "C" int thinkahead_kquant_linear(const float* x, int64_t M, int64_t K, const int* types, const uint8_t* const* weights,
                                        const int64_t* rows, const float* const* biases, int64_t parts, float* out,
                                        int threads, char* error, int64_t error_size) {
    const auto report = [&](const char* message) {
        if (error_size <= 0) return 1;
        std::strncpy(error, message, static_cast<size_t>(error_size - 1));
        error[error_size - 1] = 0;
        return 1;
    };
    try {
        linear_parts(x, M, K, types, weights, rows, biases, static_cast<size_t>(parts), out, threads);
        return 0;
    } catch (const std::exception& e) {
        return report(e.what());
    } catch (...) {
        return report("kquant linear: an unknown error");
    }
}

PYBIND11_MODULE(_kquant_native, m) {
    m.doc() = "AVX2 linears on GGUF quantized blocks (see thinkahead/models/engine/kernels/kquant.py)";
    m.attr("Q4_0") = static_cast<int>(Q4_0);
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
    m.def("linear_address", [] { return reinterpret_cast<uintptr_t>(&thinkahead_kquant_linear); },
          "the address of the C entry thinkahead_kquant_linear (layer_ops.cpp's layer loop calls it)");
    m.def("dequantize_rows", &dequantize_rows, py::arg("type"), py::arg("blocks"), py::arg("rows"), py::arg("cols"),
          py::arg("ids"), py::arg("n"), py::arg("out"), "rows `ids` (int64) of a file-layout tensor as float32 (kquant_rows.inc)");
    m.def("repack", &repack, py::arg("type"), py::arg("src"), py::arg("dst"), py::arg("rows"), py::arg("cols"),
          "rewrite blocks from the file's layout into the kernel's (src == dst: in place)");
    m.def("threading", &thinkahead_native::threading);
    m.def("tile_from", [] { return tile_from.load(); },
          "rows of x from which K-quant parts run in tiles (0: never; -1: by the ISA, the default)");
    m.def("set_tile_from", [](int64_t rows) {
        if (rows < TILE_FROM_AUTO) throw std::invalid_argument("set_tile_from: rows >= 0 (0: never), or -1 (by the ISA)");
        tile_from.store(rows);
    }, py::arg("rows"), "rows of x from which K-quant parts run in tiles of 8 or 16 (the same results; for tests and benches)");
    m.def("isa", &isa, "which build of the dot products runs: the best of avx512vnni(-amx, -zmm), avxvnni, avx2 the CPU has");
    m.def("set_isa", &set_isa, py::arg("name"),
          "avx2, avxvnni, avx512vnni, avx512vnni-zmm or avx512vnni-amx (the same results; for tests and benches)");
    m.def("zmm_pays", [] { return isa_supported(AVX512_ZMM) && zmm_pays(); },
          "whether 512-bit multiplies pay on this CPU (measured; the avx512vnni-zmm build is then the default)");
    m.def("isas", [] {
        py::list names;
        for (int which = AVX2; which <= AVX512_AMX; ++which)
            if (isa_supported(which)) names.append(ISA_NAMES[which]);
        return names;
    }, "the builds of the dot products this CPU runs");
    m.def("set_threading", &thinkahead_native::set_threading, py::arg("mode"));
}
