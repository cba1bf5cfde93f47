// Decode attention over paged K/V for XLA:CPU: out[b, h] = softmax(q[b, h] . K^T) V over the
// pages of row b, read in place from the pool.
//
// The jnp reference gathers each chunk of pages into a new array before its einsums, and
// XLA:CPU's gather from the head-major pool [L, K, P, S, 2D] runs at a tenth of the memory
// bandwidth (docs/BENCHMARKS.md); here each (row, kv head) walks its page table and reads each
// page's [S, 2D] slab where it lies: keys and values dequantized once per slot (f32, bf16, or
// int8 with the packed bf16 scale words of pallas_kernels/quant.py), shared by the G query
// heads of the kv head, with an online softmax in float32. Semantics are the reference's
// (`paged_decode_attention_reference`): row b sees positions [lo, lengths[b]) with lo the
// sliding window's start, an optional logit soft cap, and a row of length 0 returns zeros.
// (row, kv head) pairs are split over XLA's intra-op threads when there is enough work.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxkv::ParallelFor;

constexpr int kScaleRow = 128;  // scale words per row (pallas_kernels/quant.py)
constexpr int64_t kMinParallelKeys = 4096;  // (key, query head) pairs before using threads

enum class Kind { kF32, kBF16, kInt8 };

struct Problem {
  int64_t rows, heads, kv_heads, head_dim, pages, page_size, width;
  Kind kind;
  const float* q;          // [B, H, D]
  const void* kv;          // this layer's [K, P, S, 2D]
  const int32_t* table;    // [B, W]
  const int32_t* lengths;  // [B]
  const int32_t* scales;   // this layer's [K, R, G * S] words, or nullptr
  int64_t scale_row_pages, scale_rows;
  float sm_scale, soft_cap;
  int32_t window;
  float* out;  // [B, H, D]
};

float Bf16(uint32_t bits16) {
  const uint32_t bits = bits16 << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Slot s of page p of kv head k, keys and values as f32 [D] each.
inline void LoadSlot(const Problem& p, int64_t k, int64_t page, int64_t s, float* key, float* value) {
  const int64_t d = p.head_dim, row = ((k * p.pages + page) * p.page_size + s) * 2 * d;
  float ks = 1.f, vs = 1.f;
  if (p.scales) {
    const int64_t g = p.scale_row_pages;
    const uint32_t word = static_cast<uint32_t>(
        p.scales[(k * p.scale_rows + page / g) * g * p.page_size + page % g * p.page_size + s]);
    ks = Bf16(word >> 16);
    vs = Bf16(word & 0xFFFF);
  }
  switch (p.kind) {
    case Kind::kF32: {
      const float* src = static_cast<const float*>(p.kv) + row;
      std::memcpy(key, src, d * 4);
      std::memcpy(value, src + d, d * 4);
      break;
    }
    case Kind::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(p.kv) + row;
      for (int64_t i = 0; i < d; ++i) key[i] = Bf16(src[i]) * ks;
      for (int64_t i = 0; i < d; ++i) value[i] = Bf16(src[d + i]) * vs;
      break;
    }
    case Kind::kInt8: {
      const int8_t* src = static_cast<const int8_t*>(p.kv) + row;
      for (int64_t i = 0; i < d; ++i) key[i] = src[i] * ks;
      for (int64_t i = 0; i < d; ++i) value[i] = src[d + i] * vs;
      break;
    }
  }
}

// 16 partial sums, so that the compiler vectorizes without reordering a single sum.
inline float Dot(const float* a, const float* b, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < 16; ++j) s += part[j];
  return s;
}

// Row b, kv head k: its G query heads over the row's keys, into out. Compiled for AVX-512,
// AVX2 and the baseline, picked at load time (the loops above vectorize in each).
__attribute__((target_clones("avx512f", "avx2", "default")))
void RowHead(const Problem& p, int64_t b, int64_t k) {
  const int64_t d = p.head_dim, g = p.heads / p.kv_heads, s_len = p.page_size;
  float* out = p.out + (b * p.heads + k * g) * d;
  const int64_t hi = p.lengths[b];
  if (hi <= 0) {
    std::fill(out, out + g * d, 0.f);
    return;
  }
  const int64_t lo = p.window > 0 ? std::max<int64_t>(hi - p.window, 0) : 0;
  const float* q = p.q + (b * p.heads + k * g) * d;
  std::vector<float> m(g, -INFINITY), l(g, 0.f), acc(g * d, 0.f), key(d), value(d);
  for (int64_t pos = lo; pos < hi; ++pos) {
    // clamped as the reference's gather clamps: a table entry past the pool reads its end
    const int64_t page = std::clamp<int64_t>(p.table[b * p.width + pos / s_len], 0,
                                             p.pages - 1);
    LoadSlot(p, k, page, pos % s_len, key.data(), value.data());
    for (int64_t h = 0; h < g; ++h) {
      float x = Dot(q + h * d, key.data(), d) * p.sm_scale;
      if (p.soft_cap > 0.f) x = p.soft_cap * std::tanh(x / p.soft_cap);
      float* a = acc.data() + h * d;
      if (x > m[h]) {  // a new maximum: rescale what was summed under the old one
        const float alpha = std::exp(m[h] - x);
        l[h] *= alpha;
        for (int64_t i = 0; i < d; ++i) a[i] *= alpha;
        m[h] = x;
      }
      const float e = std::exp(x - m[h]);
      l[h] += e;
      for (int64_t i = 0; i < d; ++i) a[i] += e * value[i];
    }
  }
  for (int64_t h = 0; h < g; ++h) {
    const float inv = 1.f / std::max(l[h], 1e-30f);
    for (int64_t i = 0; i < d; ++i) out[h * d + i] = acc[h * d + i] * inv;
  }
}

ffi::Error PagedDecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                                ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> lengths,
                                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> scales,
                                ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap,
                                int32_t window, bool has_scales) {
  const auto qd = q.dimensions(), kd = kv.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || kd[4] != 2 * qd[2] ||
      qd[1] % kd[1] || td[0] != qd[0])
    return ffi::Error::InvalidArgument("paged decode attention: inconsistent shapes");
  Kind kind;
  switch (kv.element_type()) {
    case ffi::DataType::F32: kind = Kind::kF32; break;
    case ffi::DataType::BF16: kind = Kind::kBF16; break;
    case ffi::DataType::S8: kind = Kind::kInt8; break;
    default: return ffi::Error::InvalidArgument("paged decode attention: pages f32, bf16 or s8");
  }
  const int64_t layers = kd[0], kv_heads = kd[1], pages = kd[2], page_size = kd[3];
  const int64_t d = qd[2], lyr = std::clamp<int64_t>(layer.typed_data()[0], 0, layers - 1);
  const int64_t per_layer = kv_heads * pages * page_size * 2 * d;
  const int64_t bytes = kind == Kind::kF32 ? 4 : kind == Kind::kBF16 ? 2 : 1;
  const int64_t g = page_size < kScaleRow && kScaleRow % page_size == 0 ? kScaleRow / page_size
                                                                        : 1;
  const auto sd = scales.dimensions();
  if (has_scales && (sd.size() != 4 || sd[3] != g * page_size))
    return ffi::Error::InvalidArgument("paged decode attention: scales [L, K, R, G * S]");
  const int64_t scale_rows = has_scales ? sd[2] : 0;
  const Problem p{qd[0], qd[1], kv_heads, d, pages, page_size, td[1], kind, q.typed_data(),
                  static_cast<const char*>(kv.untyped_data()) + lyr * per_layer * bytes,
                  table.typed_data(), lengths.typed_data(),
                  has_scales ? scales.typed_data() + lyr * kv_heads * scale_rows * g * page_size
                             : nullptr,
                  g, scale_rows, sm_scale, soft_cap, window, out->typed_data()};
  const int64_t tasks = p.rows * kv_heads;
  int64_t keys = 0;
  for (int64_t b = 0; b < p.rows; ++b) keys += std::max(0, p.lengths[b]);
  auto task = [&](int64_t t) { RowHead(p, t / kv_heads, t % kv_heads); };
  if (tasks == 1 || keys * p.heads < kMinParallelKeys) {
    for (int64_t t = 0; t < tasks; ++t) task(t);
  } else {
    ParallelFor(pool, tasks, task);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPagedDecodeAttention, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("window")
                                  .Attr<bool>("has_scales"));
