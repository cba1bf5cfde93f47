// Weight-only quantized matmul for XLA:CPU: y[T, O] = x[T, I] @ dequant(q)[I, O], read as integers.
//
// XLA:CPU has no fused int4 dot, and it materializes a converted weight before a float dot, so
// a quantized weight would be slower than fp32 there. This kernel reads the integers once:
// x is quantized per token and per block of 32 inputs to int8 (as llama.cpp's Q8_0 does), the
// products accumulate in int32 per block (AVX-512 VNNI: vpdpbusd, 64 multiply-adds per
// instruction), and each block's sum is scaled in float:
//
//   y[t, o] = sum_g scale[g, o] * sum_{b in g} xs[t, b] * sum_{i in b} xq[t, i] * q[i, o]
//             + sum_g offset[g, o] * sum_{i in g} x[t, i]
//
// The offset term uses the float x, so only x's rounding to int8 differs from the reference.
// Weight layouts (pallas_kernels/quant_matmul.py): int4 u8[I/2, O], byte row r holding input
// rows 2r (low nibble) and 2r + 1 (high nibble), values 0..15 with an offset; int8 i8[I, O],
// symmetric. scale/offset f32 or f16 [G, O], G = I / group_size, group_size a multiple of 32.
//
// Loop order: columns are split into chunks across XLA's intra-op threads; within a chunk, for
// each block of 32 inputs (a panel of 16 or 32 weight rows) the chunk's columns are swept 64
// at a time, so every weight row is read left to right (the rows of one column strip lie O
// bytes apart, too far for the hardware prefetcher when O is an LM head's vocabulary). Up to
// 4 tokens share each weight load; more tokens take more passes over the chunk, whose weights
// then come from cache. Without AVX-512 VNNI a portable loop computes the same integer sums.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
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

constexpr int kBlock = 32;      // inputs per activation scale
constexpr int kLanes = 16;      // outputs per 512-bit vector
constexpr int kMaxTokens = 4;   // tokens sharing each weight load
constexpr int kPrefetchAhead = 128;  // bytes ahead in a weight row (two column groups)
constexpr int kMaxChunk = 512;  // columns per chunk (per-chunk float sums live on the stack)
constexpr int64_t kMinChunkBytes = 64 << 10;  // weight bytes read per chunk, at least

struct Problem {
  int64_t tokens, inputs, outputs, group;
  int bits;
  bool half_scales;       // scale/offset are f16 (else f32)
  const uint8_t* q;       // int4: u8[I/2, O]; int8: i8[I, O] (as bytes)
  const void* scale;      // [G, O]
  const void* offset;     // [G, O] or nullptr
  const int8_t* xq;       // [T, I] int8 activations (int4 path)
  const uint8_t* xu;      // [T, I] int8 activations + 128 (int8 path: vpdpbusd's unsigned side)
  const float* xs;        // [T, I/32] activation scales
  const float* xsum;      // [T, G] float sums of x per group (offset term)
  float* y;               // [T, O]
};

bool HasVnni() {
  // JAXKV_CPU_PORTABLE=1 forces the portable loop (tests run both paths on one machine).
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") &&
                         __builtin_cpu_supports("avx512vbmi") &&
                         !std::getenv("JAXKV_CPU_PORTABLE");
  return ok;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    f = man ? NAN : INFINITY;
  } else {
    f = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= sign;
  std::memcpy(&f, &bits, 4);
  return f;
}

float LoadScale(const Problem& p, const void* base, int64_t index) {
  return p.half_scales ? HalfToFloat(static_cast<const uint16_t*>(base)[index])
                       : static_cast<const float*>(base)[index];
}

#define JAXKV_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c")))

JAXKV_AVX512 inline __m512 LoadScales(const Problem& p, const void* base, int64_t index) {
  if (p.half_scales)
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)base + index)));
  return _mm512_loadu_ps((const float*)base + index);
}

// Four byte rows' 64 columns each -> w[j] (j = 0..3): dword n of w[j] holds the four rows'
// bytes of column 16 j + n (row 0 in its low byte), what vpdpbusd multiplies against four
// inputs. Byte unpacks interleave within 128-bit lanes; the columns are first permuted
// (vpermb) so that the unpacked dwords come out in column order.
JAXKV_AVX512 inline void Interleave4(__m512i a, __m512i b, __m512i c, __m512i d, __m512i w[4]) {
  const __m512i ab_lo = _mm512_unpacklo_epi8(a, b), ab_hi = _mm512_unpackhi_epi8(a, b);
  const __m512i cd_lo = _mm512_unpacklo_epi8(c, d), cd_hi = _mm512_unpackhi_epi8(c, d);
  w[0] = _mm512_unpacklo_epi16(ab_lo, cd_lo);
  w[1] = _mm512_unpackhi_epi16(ab_lo, cd_lo);
  w[2] = _mm512_unpacklo_epi16(ab_hi, cd_hi);
  w[3] = _mm512_unpackhi_epi16(ab_hi, cd_hi);
}

// Byte k of 128-bit lane L takes column 16 (k / 4) + 4 L + k % 4 (see Interleave4).
JAXKV_AVX512 inline __m512i ColumnOrder() {
  alignas(64) uint8_t idx[64];
  for (int lane = 0; lane < 4; ++lane)
    for (int k = 0; k < 16; ++k) idx[lane * 16 + k] = 16 * (k / 4) + 4 * lane + k % 4;
  return _mm512_load_si512(idx);
}

JAXKV_AVX512 inline __m512i LoadColumns(const uint8_t* row, __m512i order) {
  // A block sweeps its 16-32 rows 64 columns at a time: more streams than the hardware
  // prefetcher follows, so fetch each row two column groups ahead.
  _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchAhead), _MM_HINT_T0);
  return _mm512_permutexvar_epi8(order, _mm512_loadu_si512(row));
}

// Inputs i .. i + 3 of 64 columns from o, as Interleave4 lays them out.
template <int BITS>
JAXKV_AVX512 inline void Expand64(const Problem& p, int64_t i, int64_t o, __m512i order,
                                  __m512i w[4]) {
  const int64_t O = p.outputs;
  if constexpr (BITS == 4) {  // byte rows i/2 (inputs i, i + 1) and i/2 + 1 (i + 2, i + 3)
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i r0 = LoadColumns(p.q + (i / 2) * O + o, order);
    const __m512i r1 = LoadColumns(p.q + (i / 2 + 1) * O + o, order);
    Interleave4(_mm512_and_si512(r0, low), _mm512_and_si512(_mm512_srli_epi16(r0, 4), low),
                _mm512_and_si512(r1, low), _mm512_and_si512(_mm512_srli_epi16(r1, 4), low), w);
  } else {
    const uint8_t* r = p.q + i * O + o;
    Interleave4(LoadColumns(r, order), LoadColumns(r + O, order), LoadColumns(r + 2 * O, order),
                LoadColumns(r + 3 * O, order), w);
  }
}

// The same for 16 columns (a chunk's last < 64), one zero-extended row at a time.
template <int BITS>
JAXKV_AVX512 inline __m512i Expand16(const Problem& p, int64_t i, int64_t o) {
  const int64_t O = p.outputs;
  if constexpr (BITS == 4) {
    const uint8_t* r0 = p.q + (i / 2) * O + o;
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
    __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)r0));
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(r0 + O)));
    __m512i v = _mm512_or_si512(a, _mm512_slli_epi32(c, 16));
    __m512i lo = _mm512_and_si512(v, nibbles);
    __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibbles);
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 8));
  } else {
    const uint8_t* r0 = p.q + i * O + o;
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)r0));
    for (int k = 1; k < 4; ++k)
      v = _mm512_or_si512(
          v, _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(r0 + k * O))),
                               8 * k));
    return v;
  }
}

// f[t, o .. o + 16 NJ] += xs[t, b] * (integer sums of block b) for NT tokens from t0.
template <int BITS, int NJ, int NT>
JAXKV_AVX512 void Block(const Problem& p, int64_t b, int64_t o, int64_t t0, float* f,
                        int64_t f_stride) {
  const int64_t nblocks = p.inputs / kBlock;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[NT][NJ];
  __m512i wsum[NJ];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < NJ; ++j) acc[t][j] = _mm512_setzero_si512();
  for (int j = 0; j < NJ; ++j) wsum[j] = _mm512_setzero_si512();
  const __m512i order = ColumnOrder();
  for (int64_t i = b * kBlock; i < (b + 1) * kBlock; i += 4) {
    __m512i w[NJ];
    if constexpr (NJ == 4) {
      Expand64<BITS>(p, i, o, order, w);
    } else {
      for (int j = 0; j < NJ; ++j) w[j] = Expand16<BITS>(p, i, o + 16 * j);
    }
    if constexpr (BITS == 8) {  // x + 128 is vpdpbusd's unsigned side; sum(w) undoes the 128
      for (int j = 0; j < NJ; ++j) wsum[j] = _mm512_dpbusd_epi32(wsum[j], ones, w[j]);
    }
    for (int t = 0; t < NT; ++t) {
      int32_t x4;
      std::memcpy(&x4, (BITS == 4 ? reinterpret_cast<const uint8_t*>(p.xq) : p.xu) +
                           (t0 + t) * p.inputs + i, 4);
      const __m512i xv = _mm512_set1_epi32(x4);
      for (int j = 0; j < NJ; ++j) {
        acc[t][j] = BITS == 4 ? _mm512_dpbusd_epi32(acc[t][j], w[j], xv)
                              : _mm512_dpbusd_epi32(acc[t][j], xv, w[j]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    const __m512 s = _mm512_set1_ps(p.xs[(t0 + t) * nblocks + b]);
    for (int j = 0; j < NJ; ++j) {
      __m512i a = acc[t][j];
      if constexpr (BITS == 8) a = _mm512_sub_epi32(a, _mm512_slli_epi32(wsum[j], 7));
      float* ft = f + t * f_stride + 16 * j;
      _mm512_storeu_ps(ft, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), s, _mm512_loadu_ps(ft)));
    }
  }
}

// Columns [o0, o1) (at most kMaxChunk) for NT tokens from t0: block by block, the chunk's
// columns swept 64 at a time; at each group's end its float sums are scaled into y.
template <int BITS, int NT>
JAXKV_AVX512 void Chunk(const Problem& p, int64_t o0, int64_t o1, int64_t t0) {
  const int64_t O = p.outputs, width = o1 - o0, groups = p.inputs / p.group;
  const int64_t blocks_per_group = p.group / kBlock;
  alignas(64) float y[NT][kMaxChunk] = {};
  alignas(64) float f[NT][kMaxChunk];
  for (int64_t g = 0; g < groups; ++g) {
    for (int t = 0; t < NT; ++t) std::fill(f[t], f[t] + width, 0.f);
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      int64_t o = o0;
      for (; o + 4 * kLanes <= o1; o += 4 * kLanes)
        Block<BITS, 4, NT>(p, b, o, t0, &f[0][o - o0], kMaxChunk);
      for (; o < o1; o += kLanes) Block<BITS, 1, NT>(p, b, o, t0, &f[0][o - o0], kMaxChunk);
    }
    for (int64_t o = o0; o < o1; o += kLanes) {
      const __m512 sc = LoadScales(p, p.scale, g * O + o);
      const __m512 off = p.offset ? LoadScales(p, p.offset, g * O + o) : _mm512_setzero_ps();
      for (int t = 0; t < NT; ++t) {
        float* yt = &y[t][o - o0];
        __m512 v = _mm512_fmadd_ps(_mm512_load_ps(&f[t][o - o0]), sc, _mm512_load_ps(yt));
        if (p.offset) v = _mm512_fmadd_ps(off, _mm512_set1_ps(p.xsum[(t0 + t) * groups + g]), v);
        _mm512_store_ps(yt, v);
      }
    }
  }
  for (int t = 0; t < NT; ++t) std::memcpy(p.y + (t0 + t) * O + o0, y[t], width * sizeof(float));
}

template <int BITS>
void ChunkAllTokens(const Problem& p, int64_t o0, int64_t o1) {
  for (int64_t t0 = 0; t0 < p.tokens; t0 += kMaxTokens) {
    switch (std::min<int64_t>(kMaxTokens, p.tokens - t0)) {
      case 1: Chunk<BITS, 1>(p, o0, o1, t0); break;
      case 2: Chunk<BITS, 2>(p, o0, o1, t0); break;
      case 3: Chunk<BITS, 3>(p, o0, o1, t0); break;
      default: Chunk<BITS, 4>(p, o0, o1, t0); break;
    }
  }
}

// The same sums without vector extensions (any x86-64 CPU).
void ChunkPortable(const Problem& p, int64_t o0, int64_t o1) {
  const int64_t O = p.outputs, nblocks = p.inputs / kBlock, groups = p.inputs / p.group;
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int64_t o = o0; o < o1; ++o) {
      float y = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float f = 0.f;
        for (int64_t b = g * p.group / kBlock; b < (g + 1) * p.group / kBlock; ++b) {
          int32_t acc = 0;
          for (int64_t i = b * kBlock; i < (b + 1) * kBlock; ++i) {
            int32_t w;
            if (p.bits == 4) {
              const uint8_t byte = p.q[(i / 2) * O + o];
              w = (i & 1) ? (byte >> 4) : (byte & 15);
            } else {
              w = static_cast<int8_t>(p.q[i * O + o]);
            }
            acc += w * (p.bits == 4 ? p.xq[t * p.inputs + i]
                                    : static_cast<int32_t>(p.xu[t * p.inputs + i]) - 128);
          }
          f += p.xs[t * nblocks + b] * static_cast<float>(acc);
        }
        y += f * LoadScale(p, p.scale, g * O + o);
        if (p.offset) y += LoadScale(p, p.offset, g * O + o) * p.xsum[t * groups + g];
      }
      p.y[t * O + o] = y;
    }
  }
}

void Columns(const Problem& p, int64_t o0, int64_t o1) {
  if (!HasVnni()) return ChunkPortable(p, o0, o1);
  if (p.bits == 4) return ChunkAllTokens<4>(p, o0, o1);
  ChunkAllTokens<8>(p, o0, o1);
}

// Activations to int8 per block of 32 (absmax), their scales, and float sums per group.
void QuantizeActivations(const float* x, int64_t tokens, int64_t inputs, int64_t group,
                         std::vector<int8_t>& xq, std::vector<uint8_t>& xu,
                         std::vector<float>& xs, std::vector<float>& xsum) {
  const int64_t nblocks = inputs / kBlock, groups = inputs / group;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const float* v = x + t * inputs + b * kBlock;
      float amax = 0.f;
      for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      xs[t * nblocks + b] = amax / 127.f;
      for (int k = 0; k < kBlock; ++k) {
        const int32_t r = static_cast<int32_t>(std::nearbyint(v[k] * inv));
        const int32_t c = std::clamp(r, -127, 127);
        xq[t * inputs + b * kBlock + k] = static_cast<int8_t>(c);
        xu[t * inputs + b * kBlock + k] = static_cast<uint8_t>(c + 128);
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) s += x[t * inputs + i];
      xsum[t * groups + g] = s;
    }
  }
}

ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                           ffi::AnyBuffer scale, ffi::AnyBuffer offset,
                           ffi::ResultBuffer<ffi::F32> y, int32_t bits, bool has_offset) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("x, q and scale must be 2-D");
  const int64_t tokens = xd[0], inputs = xd[1], outputs = qd[1], groups = sd[0];
  if ((bits != 4 && bits != 8) || qd[0] * (8 / bits) != inputs || sd[1] != outputs ||
      groups <= 0 || inputs % groups || (inputs / groups) % kBlock || outputs % kLanes)
    return ffi::Error::InvalidArgument("quantized matmul: inconsistent shapes");
  const bool half = scale.element_type() == ffi::DataType::F16;
  if ((!half && scale.element_type() != ffi::DataType::F32) ||
      offset.element_type() != scale.element_type())
    return ffi::Error::InvalidArgument("quantized matmul: scale/offset must be f32 or f16");
  const int64_t group = inputs / groups, nblocks = inputs / kBlock;
  std::vector<int8_t> xq(tokens * inputs);
  std::vector<uint8_t> xu(tokens * inputs);
  std::vector<float> xs(tokens * nblocks), xsum(tokens * groups);
  QuantizeActivations(x.typed_data(), tokens, inputs, group, xq, xu, xs, xsum);
  const Problem p{tokens, inputs, outputs, group, static_cast<int>(bits), half,
                  static_cast<const uint8_t*>(q.untyped_data()), scale.untyped_data(),
                  has_offset ? offset.untyped_data() : nullptr, xq.data(), xu.data(),
                  xs.data(), xsum.data(), y->typed_data()};
  // A few chunks per thread, so that a thread slowed by another process does not hold the
  // others back; but at least kMinChunkBytes of weight reads each (a decode step's small
  // projections run on the calling thread alone: waking a helper costs more than they do),
  // and at most kMaxChunk columns.
  const int64_t units = outputs / kLanes;
  const int64_t passes = (tokens + kMaxTokens - 1) / kMaxTokens;
  const int64_t work = inputs * outputs * bits / 8 * passes;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t target = std::max<int64_t>(
      std::min<int64_t>(4 * threads, std::max<int64_t>(1, work / kMinChunkBytes)),
      (outputs + kMaxChunk - 1) / kMaxChunk);
  // whole groups of 64 columns where there are some (the 16-column tail path is slower)
  int64_t per = (units + target - 1) / target;
  if (units >= 4) per = (per + 3) & ~int64_t{3};
  per = std::min<int64_t>(kMaxChunk / kLanes, per);
  const int64_t chunks = (units + per - 1) / per;
  auto chunk = [&](int64_t c) {
    Columns(p, c * per * kLanes, std::min(outputs, (c + 1) * per * kLanes));
  };
  if (chunks == 1) {
    chunk(0);
  } else {
    ParallelFor(pool, chunks, chunk);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvQuantizedMatmul, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("bits")
                                  .Attr<bool>("has_offset"));

extern "C" int JaxkvQuantizedMatmulHasVnni() { return HasVnni() ? 1 : 0; }
