// The row-wise parts of a Qwen2 decoder layer around its linears and attention, for
// thinkahead/models/engine/kernels/layer_ops.py: RMS norm, the rotary embedding with the q/k/v split, and attention
// (attention.inc), SiLU times up; and a GGUF model's whole layer stack in one call (layer_loop.inc). Each
// replaces a handful of small torch ops per layer (a dispatch, an allocation and a Python call each).
//
// Exactness: every output row is computed on its own, in one fixed order, whatever the number of rows
// in the call: verifying k drafted tokens computes exactly what decoding them one at a time computes.
// The rotary embedding is transformers' own arithmetic, float32 op for op (q * cos + rotate_half(q) *
// sin, no contraction: -ffp-contract=off), so its results are transformers' bits; the norm's mean of
// squares accumulates in float64 (transformers: float32, in torch's reduction order).

#include <pybind11/pybind11.h>

#include "parallel.hpp"  // as_ptr, run_chunks

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;
using thinkahead_native::as_ptr;

namespace {

constexpr int LANES = 8;  // partial sums of the norm's sum of squares: a fixed order the compiler keeps in vectors

// out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), the mean in float64
void rms_norm_rows(const float* xs, int64_t rows, int64_t dim, const float* w, double eps, float* o) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* v = xs + r * dim;
        double acc[LANES] = {};
        int64_t d = 0;
        for (; d + LANES <= dim; d += LANES)
            for (int l = 0; l < LANES; ++l) acc[l] += static_cast<double>(v[d + l]) * v[d + l];
        for (int l = 0; d < dim; ++d, ++l) acc[l] += static_cast<double>(v[d]) * v[d];
        const double ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + eps));
        for (int64_t i = 0; i < dim; ++i) o[r * dim + i] = w[i] * (v[i] * scale);
    }
}

void rms_norm(uintptr_t x, int64_t rows, int64_t dim, uintptr_t weight, double eps, uintptr_t out) {
    if (rows < 0 || dim <= 0) throw std::invalid_argument("rms_norm: bad shape");
    py::gil_scoped_release release;
    rms_norm_rows(as_ptr<const float>(x), rows, dim, as_ptr<const float>(weight), eps, as_ptr<float>(out));
}

// qkv [T, (hq + 2 hkv) * D] float32 -> q [hq, T, D], k [hkv, T, D] (both rotated), v [hkv, T, D], float32 (what
// attention.inc reads); cos/sin [T, D] float32 (transformers' rotary embedding, both halves)
void rope_split_rows(const float* x, int64_t T, int64_t hq, int64_t hkv, int64_t D, const float* c, const float* s,
                     float* qo, float* ko, float* vo) {
    if (T < 0 || hq <= 0 || hkv <= 0 || D <= 0 || D % 2 || hq % hkv)
        throw std::invalid_argument("rope_split: bad shape (D even, query heads a multiple of kv heads)");
    const int64_t width = (hq + 2 * hkv) * D, half = D / 2;
    for (int64_t t = 0; t < T; ++t) {
        const float* row = x + t * width;
        const float* ct = c + t * D;
        const float* st = s + t * D;
        for (int64_t h = 0; h < hq + hkv; ++h) {  // query heads, then key heads
            const float* in = row + h * D;
            float* out = h < hq ? qo + (h * T + t) * D : ko + ((h - hq) * T + t) * D;
            for (int64_t d = 0; d < D; ++d) {
                const float rotated = d < half ? -in[d + half] : in[d - half];
                const float a = in[d] * ct[d];
                const float b = rotated * st[d];
                out[d] = a + b;
            }
        }
        for (int64_t h = 0; h < hkv; ++h) std::memcpy(vo + (h * T + t) * D, row + (hq + hkv + h) * D, D * sizeof(float));
    }
}

void rope_split(uintptr_t qkv, int64_t T, int64_t hq, int64_t hkv, int64_t D, uintptr_t cos, uintptr_t sin,
                uintptr_t q_out, uintptr_t k_out, uintptr_t v_out) {
    py::gil_scoped_release release;
    rope_split_rows(as_ptr<const float>(qkv), T, hq, hkv, D, as_ptr<const float>(cos), as_ptr<const float>(sin),
                    as_ptr<float>(q_out), as_ptr<float>(k_out), as_ptr<float>(v_out));
}

}  // namespace

#include "attention.inc"
#include "layer_loop.inc"

PYBIND11_MODULE(_layer_native, m) {
    m.doc() = "Row-wise decoder-layer ops (RMS norm, rotary split, attention, SiLU x up) and the GGUF layer loop "
              "(see thinkahead/models/engine/kernels/layer_ops.py)";
    m.def("cpu_supported", [] { return true; }, "plain C++: every x86-64 CPU");
    m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("rows"), py::arg("dim"), py::arg("weight"), py::arg("eps"),
          py::arg("out"));
    m.def("rope_split", &rope_split, py::arg("qkv"), py::arg("t"), py::arg("hq"), py::arg("hkv"), py::arg("d"),
          py::arg("cos"), py::arg("sin"), py::arg("q_out"), py::arg("k_out"), py::arg("v_out"));
    m.def("attention", &attention, py::arg("q"), py::arg("b"), py::arg("t"), py::arg("hq"), py::arg("hkv"), py::arg("d"),
          py::arg("k"), py::arg("v"), py::arg("s"), py::arg("batch_stride"), py::arg("head_stride"), py::arg("mask"),
          py::arg("mask_batch_stride"), py::arg("scale"), py::arg("out"), py::arg("threads"),
          "float32 attention whose rows never depend on the call's shape (attention.inc)");
    m.def("attention_tile_rows", &attention_tile_rows, py::arg("rows") = 0,
          "query rows per attention tile (6, or 12 with AVX-512VL); sets it unless 0, returns the one before");
    m.def("silu_mul", &silu_mul, py::arg("gate_up"), py::arg("rows"), py::arg("i"), py::arg("out"),
          "out [rows, i] = silu(gate_up[:, :i]) * gate_up[:, i:] (layer_loop.inc)");
    py::class_<Layers>(m, "Layers", py::dynamic_attr(), "a model's decoder layers in one native call (layer_loop.inc)")
        .def(py::init<uintptr_t, int64_t, const py::list&, uintptr_t, double>(), py::arg("linear_address"),
             py::arg("hidden"), py::arg("layers"), py::arg("final_norm"), py::arg("final_eps"))
        .def("__len__", &Layers::size)
        .def("run", &Layers::run, py::arg("h"), py::arg("b"), py::arg("t"), py::arg("hidden"), py::arg("cos"),
             py::arg("sin"), py::arg("rotary"), py::arg("mask"), py::arg("mask_batch_stride"), py::arg("held"),
             py::arg("keys"), py::arg("values"),
             py::arg("capacity"), py::arg("out"), py::arg("threads"))
        .def("run_ragged", &Layers::run_ragged, py::arg("h"), py::arg("rows"), py::arg("hidden"), py::arg("cos"),
             py::arg("sin"), py::arg("rotary"), py::arg("segments"), py::arg("out"), py::arg("threads"),
             "a ragged batch: each sequence its own rows, cache and mask (layer_loop.inc)");
}
