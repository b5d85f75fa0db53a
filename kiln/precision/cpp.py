"""C++ for rounding to low-precision formats, shared by Kiln's generated kernels.

Low level on purpose (imports only :mod:`kiln.precision.formats`): the code generator includes
:data:`HELPERS` in every translation unit and calls the expression builders below.

Random bits are counter based: ``kp_rand64(key, i)`` is SplitMix64's finalizer applied to
``key + i * golden_gamma``, where ``key`` mixes (seed, step) on the Python side
(:func:`kiln.precision.rounding.next_key`) and ``i`` is the element's index.  The key is a
run-time kernel argument, so a fixed seed reproduces every bit and no kernel is rebuilt per step.
Everything is branch-free integer arithmetic, so the loops stay vectorizable.

Stochastic rounding to bf16 adds 16 random bits below bf16's last mantissa bit and truncates:
a value is rounded up with probability equal to its distance from the lower neighbour in units
of the gap, so E[SR(x)] = x.  NaN is masked explicitly (the add would turn 0x7F800001 into inf);
+-inf and -0.0 come out unchanged; fp32 values above bf16's max round to max or inf.
"""

from __future__ import annotations

from kiln.precision.formats import FloatFormat

HELPERS = r"""
// ---- kiln.precision: rounding to bf16 / fp16 / fp8 (round-to-nearest-even or stochastic) ----
static inline uint32_t kp_bits(float x) { uint32_t u; __builtin_memcpy(&u, &x, 4); return u; }
static inline float kp_float(uint32_t u) { float x; __builtin_memcpy(&x, &u, 4); return x; }
static inline uint64_t kp_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
static inline uint64_t kp_rand64(uint64_t key, int64_t i) {
  return kp_mix64(key + (uint64_t)i * 0x9E3779B97F4A7C15ULL);
}
static inline bool kp_isnan(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }
static inline float kp_bf16_load(uint16_t h) { return kp_float((uint32_t)h << 16); }
static inline uint16_t kp_bf16_rne(float x) {
  const uint32_t u = kp_bits(x);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)(kp_isnan(u) ? ((u >> 16) | 0x40u) : r);
}
static inline uint16_t kp_bf16_sr(float x, uint64_t rnd) {
  const uint32_t u = kp_bits(x);
  const uint32_t r = (u + (uint32_t)(rnd >> 48)) >> 16;
  return (uint16_t)(kp_isnan(u) ? ((u >> 16) | 0x40u) : r);
}
// x rounded to a grid with `mb` mantissa bits whose smallest normal exponent is `emin`, as an
// exact float; no overflow handling (callers compare with the format's max); inf/NaN pass.
static inline float kp_round_grid(float x, int mb, int emin, bool sr, uint64_t rnd) {
  const uint32_t u = kp_bits(x), a = u & 0x7FFFFFFFu;
  const int eraw = (int)(a >> 23);
  const int e = eraw ? eraw - 127 : -126;
  const uint64_t m = (uint64_t)((a & 0x7FFFFFu) | (eraw ? 0x800000u : 0u));
  const int ee = e > emin ? e : emin;
  int s = 23 - mb + (ee - e);
  s = s > 62 ? 62 : s;
  const uint64_t add = sr ? (rnd >> (64 - s)) : (((1ULL << (s - 1)) - 1) + ((m >> s) & 1));
  const uint64_t q = (m + add) >> s;
  const float v = (float)q * kp_float((uint32_t)(ee - mb + 127) << 23);
  return a >= 0x7F800000u ? x : kp_float(kp_bits(v) | (u & 0x80000000u));
}
static inline _Float16 kp_fp16_rne(float x) { return (_Float16)x; }
static inline _Float16 kp_fp16_sr(float x, uint64_t rnd) {
  return (_Float16)kp_round_grid(x, 10, -14, true, rnd);
}
static inline float kp_fp16_load(_Float16 h) { return (float)h; }
"""


def encode_fn(fmt: FloatFormat, sr: bool, saturate: bool) -> tuple[str, str]:
    """(function name, C++ source) of ``uint8/16 f(float y, uint64_t rnd)``: ``y`` rounded to
    ``fmt`` (round-to-nearest-even, or stochastic with ``rnd``) and encoded.  Overflow: the max
    finite value when ``saturate`` (+-inf too), else inf (formats that have it) or NaN."""
    name = f"kp_enc_{fmt.name}_{'sr' if sr else 'rne'}_{'sat' if saturate else 'ovf'}"
    ct = "uint8_t" if fmt.bits <= 8 else "uint16_t"
    sign_shift = 32 - fmt.bits
    max_bits = f"0x{_f32_bits(fmt.max):08X}u"
    normal_bits = f"0x{_f32_bits(fmt.min_normal):08X}u"
    sub_scale = f"0x{_f32_bits(2.0 ** (fmt.mbits - fmt.emin)):08X}u"
    if saturate:
        over = f"{fmt.max_code}u | sg"
    elif fmt.has_inf:
        over = f"{fmt.inf_code}u | sg"
    else:
        over = f"{fmt.nan_code}u"
    nan = f"{fmt.nan_code}u" if fmt.encoding == "fnuz" else f"{fmt.nan_code}u | sg"
    # fnuz has no negative zero: a zero magnitude drops its sign
    finite = "(mag == 0u ? 0u : (mag | sg))" if fmt.encoding == "fnuz" else "(mag | sg)"
    src = f"""static inline {ct} {name}(float y, uint64_t rnd) {{
  const float v = kp_round_grid(y, {fmt.mbits}, {fmt.emin}, {"true" if sr else "false"}, rnd);
  const uint32_t u = kp_bits(v), a = u & 0x7FFFFFFFu;
  const uint32_t sg = (u >> {sign_shift}) & {fmt.sign_bit}u;
  const uint32_t nrm = ((((a >> 23) - 127u + {fmt.bias}u) << {fmt.mbits}) |
                        ((a >> {23 - fmt.mbits}) & {(1 << fmt.mbits) - 1}u));
  const uint32_t sub = (uint32_t)(kp_float(a) * kp_float({sub_scale}));
  const uint32_t mag = a >= {normal_bits} ? nrm : sub;
  const uint32_t r = kp_isnan(u) ? ({nan}) : (a > {max_bits} ? ({over}) : {finite});
  return ({ct})r;
}}
"""
    return name, src


def _f32_bits(v: float) -> int:
    import struct

    return struct.unpack("<I", struct.pack("<f", v))[0]


# ---- what the code generator calls for bf16 / fp16 values in fused kernels -------------------
# Inside a kernel every value is computed in float; a body entry whose dtype is bf16 / fp16 is
# rounded to that format right where it is computed (as eager PyTorch rounds every op's result),
# stochastically when the switch is on, so that stores are exact bit moves.

LOWP = ("bf16", "f16")  # dtype abbreviations (kiln.ir.graph.dtype_abbr)
STORAGE = {"bf16": "uint16_t", "f16": "_Float16"}
SR_KEY = "kp_srkey"  # the kernel-local name of the run-time random key
_SALT = 0x632BE59BD9B4E019


def load_expr(abbr: str, ref: str) -> str:
    """``ref`` (an element in memory) as a float."""
    return f"kp_bf16_load({ref})" if abbr == "bf16" else f"((float)({ref}))"


def round_expr(abbr: str, expr: str, sr: bool, salt: int) -> str:
    """The float ``expr`` rounded to ``abbr``'s format (still a float).  ``salt`` tells apart the
    roundings of one kernel, so each draws its own random bits for element ``i``."""
    if not sr:
        if abbr == "bf16":
            return f"kp_bf16_load(kp_bf16_rne({expr}))"
        return f"((float)(_Float16)({expr}))"
    rnd = f"kp_rand64({SR_KEY} ^ 0x{(salt * _SALT) & (2**64 - 1):016X}ULL, i)"
    if abbr == "bf16":
        return f"kp_bf16_load(kp_bf16_sr({expr}, {rnd}))"
    return f"((float)kp_fp16_sr({expr}, {rnd}))"


def store_expr(abbr: str, value: str) -> str:
    """A float that is already a ``abbr`` value, as its storage type (exact)."""
    if abbr == "bf16":
        return f"(uint16_t)(kp_bits({value}) >> 16)"
    return f"(_Float16)({value})"


def key_prologue(slot: str) -> str:
    """C++ declaring the random key from two doubles ``D[slot]``, ``D[slot + 1]`` (low, high)."""
    return f"  const uint64_t {SR_KEY} = (uint64_t)D[{slot}] | ((uint64_t)D[{slot} + 1] << 32);"


# Standalone stochastic casts, for results of ops that run through ATen (see kiln.precision.aten_sr)
CAST_KERNELS = r"""
extern "C" void kp_sr_cast_bf16(const float* x, uint16_t* y, int64_t n, uint64_t key) {
  #pragma omp parallel for simd if(parallel: n >= 32768)
  for (int64_t i = 0; i < n; ++i) y[i] = kp_bf16_sr(x[i], kp_rand64(key, i));
}
extern "C" void kp_sr_cast_fp16(const float* x, _Float16* y, int64_t n, uint64_t key) {
  #pragma omp parallel for simd if(parallel: n >= 32768)
  for (int64_t i = 0; i < n; ++i) y[i] = kp_fp16_sr(x[i], kp_rand64(key, i));
}
"""
CAST_NAMES = {"bf16": "kp_sr_cast_bf16", "f16": "kp_sr_cast_fp16"}
