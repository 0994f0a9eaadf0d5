// Part of products.cu (included there, in order, inside namespace mxscope::gpu):
// GEMM operands in canonical form.
// ================================================================================================
// GEMM operands in canonical form.
//
// Canonical operand: [rows, depth] with the reduction contiguous (rows = the M or N side). Block
// scale exponents are stored block-major, [blocks][rows], so that neighbouring output entries read
// neighbouring exponents. A NaN block's exponent is nan_block_exponent (as in src/gemm.cpp).

namespace {

constexpr int nan_block_exponent = 1 << 20;

// Elements as integers: value * 2^fraction_bits, where 2^-fraction_bits is the format's subnormal
// spacing, so every finite element is an integer of magnitude <= max_normal * 2^fraction_bits.
int fraction_bits_of(element_kind kind) { return -core_ns::subnormal_ulp_exponent(kind); }
std::int64_t integer_max_of(element_kind kind) {
  return static_cast<std::int64_t>(core_ns::max_normal(kind) * core_ns::pow2(fraction_bits_of(kind)));
}
int bits_of(std::int64_t value) { return core_ns::bit_length(static_cast<core_ns::uint128>(value)); }

// Bits of the largest |integer block dot| (the CPU's fast-path bound).
int block_dot_bits(element_kind a, element_kind b, int block) {
  return bits_of(block) + bits_of(integer_max_of(a)) + bits_of(integer_max_of(b));
}

bool tensor_core_element(element_kind kind) {
  // The integer element fits a signed byte: fp4 (2q, |.| <= 12), fp6 e2m3 (8q, <= 60), int8 (64q, <= 127).
  return kind == element_kind::fp4_e2m1 || kind == element_kind::fp6_e2m3 || kind == element_kind::int8;
}

__device__ inline std::uint32_t load_code(const mx_operand_view& operand, bool packed, std::int64_t row_bytes,
                                          std::int64_t r, std::int64_t c) {
  if (packed) {
    const std::uint8_t byte = operand.codes[r * row_bytes + c / 2];
    return (c % 2 == 0) ? (byte & 0x0FU) : (byte >> 4);
  }
  return operand.codes[r * operand.cols + c];
}

// The decoded forms of every code of the operand's element format (at most 8 bits), made once per
// thread block so that each element is a table lookup (decoding each element from its bits kept
// the issue slots busy, BENCHMARKS.md): the value (float, exact), the integer value * 2^fraction_bits
// (exact; 0 where the code is not finite), and whether it is finite.
struct code_table {
  float value[256];
  std::int32_t integer[256];
  std::uint8_t finite[256];
};

__device__ inline void fill_code_table(code_table& table, core_ns::element_kind element, int fraction_bits) {
  const int threads = static_cast<int>(blockDim.x * blockDim.y);
  for (int c = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x); c < 256; c += threads) {
    const double value = core_ns::decode(element, static_cast<std::uint32_t>(c));
    const bool finite = is_finite(value);
    table.value[c] = static_cast<float>(value);
    table.integer[c] = finite ? static_cast<std::int32_t>(value * core_ns::pow2(fraction_bits)) : 0;
    table.finite[c] = finite ? 1 : 0;
  }
  __syncthreads();
}

// One element of the canonical operand from its code: the decoded value (float), the integer
// (int32) and the signed byte; `at` = row * depth + k, `t` = row * stride + k.
__device__ inline void store_canonical_element(const code_table& table, std::uint32_t code, std::int64_t at,
                                               std::int64_t t, float* elements, std::int32_t* integers,
                                               std::int8_t* bytes, int* nonfinite_flag) {
  if (elements != nullptr) elements[at] = table.value[code];
  if (table.finite[code] == 0) {
    *nonfinite_flag = 1;
    if (integers != nullptr) integers[at] = 0;
    if (bytes != nullptr) bytes[t] = 0;
    return;
  }
  if (integers != nullptr) integers[at] = table.integer[code];
  if (bytes != nullptr) bytes[t] = static_cast<std::int8_t>(table.integer[code]);
}

// Elements of the canonical operand of an operand blocked along its rows (axis 1): the canonical
// rows are the stored ones. Decoded values, integers and signed bytes padded to `stride` (a
// multiple of 32) for the tensor cores; each output may be null.
__global__ void prepare_elements_kernel(mx_operand_view operand, std::int64_t rows, std::int64_t depth,
                                        std::int64_t stride, int fraction_bits, float* elements, std::int32_t* integers,
                                        std::int8_t* bytes, int* nonfinite_flag) {
  __shared__ code_table table;
  fill_code_table(table, operand.element, fraction_bits);
  const bool packed = core_ns::spec(operand.element).bits == 4;
  const std::int64_t row_bytes = packed ? (operand.cols + 1) / 2 : operand.cols;
  MXSCOPE_GRID_LOOP(t, rows * stride) {
    const std::int64_t row = t / stride;
    const std::int64_t k = t % stride;
    if (k >= depth) {
      if (bytes != nullptr) bytes[t] = 0;
      continue;
    }
    store_canonical_element(table, load_code(operand, packed, row_bytes, row, k), row * depth + k, t, elements,
                            integers, bytes, nonfinite_flag);
  }
}

// The same for an operand blocked along its columns (axis 0), whose canonical rows are the stored
// columns: a tile of 32 stored rows x 32 stored columns goes through shared memory, read along the
// stored rows and written along the canonical ones, so that both sides are coalesced (reading
// each canonical row's codes straight from the stored layout touches a stored row per element).
// Blocks of prepare_tile x prepare_tile_rows threads.
constexpr int prepare_tile = 32;
constexpr int prepare_tile_rows = 8;

__global__ void prepare_elements_columns_kernel(mx_operand_view operand, std::int64_t rows, std::int64_t depth,
                                                std::int64_t stride, int fraction_bits, float* elements,
                                                std::int32_t* integers, std::int8_t* bytes, int* nonfinite_flag) {
  __shared__ std::uint8_t codes[prepare_tile][prepare_tile + 1];
  __shared__ code_table table;
  fill_code_table(table, operand.element, fraction_bits);
  const bool packed = core_ns::spec(operand.element).bits == 4;
  const std::int64_t row_bytes = packed ? (operand.cols + 1) / 2 : operand.cols;
  const int x = static_cast<int>(threadIdx.x);
  const int y = static_cast<int>(threadIdx.y);
  const std::int64_t tiles_k = (stride + prepare_tile - 1) / prepare_tile;
  const std::int64_t tiles = tiles_k * ((rows + prepare_tile - 1) / prepare_tile);
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const std::int64_t k0 = (tile % tiles_k) * prepare_tile;
    const std::int64_t row0 = (tile / tiles_k) * prepare_tile;
    for (int i = y; i < prepare_tile; i += prepare_tile_rows) {  // stored row k0 + i, column row0 + x
      const std::int64_t k = k0 + i;
      const std::int64_t row = row0 + x;
      const bool inside = k < depth && row < rows;
      codes[i][x] = inside ? static_cast<std::uint8_t>(load_code(operand, packed, row_bytes, k, row)) : 0;
    }
    __syncthreads();
    for (int i = y; i < prepare_tile; i += prepare_tile_rows) {  // canonical row row0 + i, k0 + x
      const std::int64_t row = row0 + i;
      const std::int64_t k = k0 + x;
      if (row >= rows || k >= stride) continue;
      const std::int64_t t = row * stride + k;
      if (k >= depth) {
        if (bytes != nullptr) bytes[t] = 0;
        continue;
      }
      store_canonical_element(table, codes[x][i], row * depth + k, t, elements, integers, bytes, nonfinite_flag);
    }
    __syncthreads();
  }
}

__global__ void prepare_exponents_kernel(mx_operand_view operand, std::int64_t rows, std::int64_t blocks,
                                         std::int32_t* exponents) {
  const bool along_rows = operand.axis == 1;
  MXSCOPE_GRID_LOOP(t, blocks * rows) {
    const std::int64_t b = t / rows;
    const std::int64_t row = t % rows;
    const std::uint8_t code = along_rows ? operand.scales[row * blocks + b] : operand.scales[b * operand.cols + row];
    exponents[t] = code == core_ns::scale_nan_code ? nan_block_exponent : core_ns::scale_exponent(code);
  }
}

// The tensor-core fp32-block kernel's view of the block exponents (tensor_core_block_kernel): per
// block and row, [blocks, padded rows], the bits of the fp32 scale 2^(e - fraction_bits) where
// -126 <= e - fraction_bits <= tc_scale_high (a normal float; 1.5 * 2^23 times it stays finite),
// and elsewhere the sign bit over the low 31 bits of e - fraction_bits (nan_block_exponent itself
// for a NaN block; tc_scale_exponent decodes both); padded rows hold 0. Per block and 128-row tile
// a flag, set where some row of the tile lies outside the range: the kernel then takes the general
// step (tensor_core_step) for the whole tile in that block.
constexpr int tc_scale_row_pad = 256;  // padded rows: a multiple of both kernel tiles (128, 256)
constexpr int tc_flag_rows = 128;
constexpr int tc_scale_low = -126;
constexpr int tc_scale_high = 100;

__global__ void prepare_tensor_core_scales_kernel(const std::int32_t* exponents, std::int64_t rows,
                                                  std::int64_t padded_rows, std::int64_t blocks, int fraction_bits,
                                                  std::uint32_t* scales, unsigned* slow_tiles) {
  MXSCOPE_GRID_LOOP(t, blocks * padded_rows) {
    const std::int64_t b = t / padded_rows;
    const std::int64_t row = t % padded_rows;
    std::uint32_t scale = 0;
    if (row < rows) {
      const std::int32_t exponent = exponents[b * rows + row];
      const std::int32_t power = exponent == nan_block_exponent ? nan_block_exponent : exponent - fraction_bits;
      if (exponent != nan_block_exponent && power >= tc_scale_low && power <= tc_scale_high) {
        scale = static_cast<std::uint32_t>(power + 127) << 23;
      } else {
        scale = 0x80000000U | (static_cast<std::uint32_t>(power) & 0x7FFFFFFFU);
        atomicMax(&slow_tiles[b * (padded_rows / tc_flag_rows) + row / tc_flag_rows], 1U);
      }
    }
    scales[t] = scale;
  }
}

// The 128-byte swizzle of the wgmma matrix descriptors, for rows of 128 bytes: 16-byte chunk c of
// row r sits at chunk c ^ (r mod 8). swizzled_chunk is its byte offset within the row.
__device__ inline int swizzled_chunk(int row, int chunk) { return (chunk ^ (row & 7)) << 4; }
__device__ inline int swizzled_offset(int row, int chunk) { return row * 128 + swizzled_chunk(row, chunk); }

// The operands of the scaled kernel (tensor_core_scaled_kernel; MXFP4 only): element (row, k) as
// the bf16 number q 2^e, i.e. the prepared byte 2q times 2^(e - 1). That is exact and normal for
// every nonzero element when -125 <= e <= 125 (|2q| <= 12 has at most two significant bits);
// blocks outside that range get zeros, and the operand then does not fit (scaled_kernel_fits).
// The layout is the kernel's shared-memory stage, so that one bulk copy moves a tile: rows padded
// to a multiple of 256 and k to a multiple of 64 (zeros), tiles of 128 rows x 64 k (16 KiB,
// row-tile major, then k), each row 128 bytes in the 128-byte swizzle (its 16-byte chunk c at
// c ^ (row mod 8)). range[0] and range[1] collect the lowest and highest exponent of a block with
// a nonzero element as maxima of 1000 - e and 1000 + e (0: no such block), range[2] whether a NaN
// block is present.
constexpr std::uint32_t scaled_range_offset = 1000;
constexpr int scaled_row_pad = 256;
constexpr int scaled_tile_rows = 128;
constexpr int scaled_tile_bytes = scaled_tile_rows * 128;

__global__ void prepare_scaled_kernel(const std::int8_t* bytes, const std::int32_t* exponents, std::int64_t rows,
                                      std::int64_t blocks, std::int64_t stride, unsigned char* scaled,
                                      unsigned* range) {
  const std::int64_t chunks = (blocks + 1) / 2;  // 64-element chunks per row
  unsigned lowest = 0, highest = 0, nan_block = 0;
  MXSCOPE_GRID_LOOP(t, rows * blocks) {
    const std::int64_t row = t / blocks;
    const std::int64_t b = t % blocks;
    const std::int32_t e = exponents[b * rows + row];
    const std::int8_t* const source = bytes + row * stride + 32 * b;
    const std::int64_t r = row % scaled_tile_rows;
    unsigned char* const tile_row =
        scaled + ((row / scaled_tile_rows) * chunks + b / 2) * scaled_tile_bytes + r * 128;
    const bool representable = e >= -125 && e <= 125;
    const float unit = core_ns::bits_float(static_cast<std::uint32_t>(representable ? e - 1 + 127 : 127) << 23);
    bool nonzero = false;
    for (int q = 0; q < 4; ++q) {  // the block's four 16-byte chunks: 4 (b mod 2) + q of the row
      std::uint32_t words[4];
      for (int w = 0; w < 4; ++w) {
        std::uint32_t pair = 0;
        for (int h = 0; h < 2; ++h) {
          const int value = source[8 * q + 2 * w + h];
          nonzero = nonzero || value != 0;
          const std::uint32_t half =
              representable ? core_ns::float_bits(__fmul_rn(static_cast<float>(value), unit)) >> 16 : 0U;
          pair |= half << (16 * h);
        }
        words[w] = pair;
      }
      const int chunk = static_cast<int>(4 * (b % 2)) + q;
      *reinterpret_cast<uint4*>(tile_row + swizzled_chunk(static_cast<int>(r), chunk)) =
          make_uint4(words[0], words[1], words[2], words[3]);
    }
    if (e == nan_block_exponent) {
      nan_block = 1;
    } else if (nonzero) {
      lowest = std::max(lowest, static_cast<unsigned>(static_cast<std::int32_t>(scaled_range_offset) - e));
      highest = std::max(highest, static_cast<unsigned>(static_cast<std::int32_t>(scaled_range_offset) + e));
    }
  }
  atomicMax(&range[0], lowest);
  atomicMax(&range[1], highest);
  atomicMax(&range[2], nan_block);
}

// The fp8 operands of the scaled kernel (tensor_core_scaled_kernel<true>; MXFP4 only). Per 128-row
// tile and K-block a base exponent b; element (row, k) is q 2^(e - b) as an fp8 e5m2 number, which
// is exact (|2q| <= 12 has at most two significant bits) while -15 <= e - b <= 13: from 0.5 2^-15,
// e5m2's least subnormal, to 6 2^13 = 49152. So b exists when the tile's blocks with a nonzero
// element span at most 28 exponents (lo .. hi): any b in [hi - 13, lo + 15]; the kernel takes the
// one nearest 0 (0 for a tile without such blocks), so that wherever scaled_kernel_fits holds the
// step's scale 2^(ba + bb) is a normal fp32 number (both bases negative: ba + bb = lo_a + lo_b + 30
// >= -94; both positive: hi_a + hi_b - 26 <= 91; else between -110 and 112). The layout is the
// kernel's stage: tiles of 128 rows x 128 k (16 KiB; four K-blocks of 32 bytes per 128-byte row,
// the same swizzle as the bf16 tiles), rows padded to 256 and k to 128; the bases as int32
// [row tiles][k tiles][4], 16 bytes per tile. fp8_tile_bases_kernel sets range[0] when some
// tile spans more than 28 exponents (or holds a NaN block), and the operand then does not fit.
constexpr int fp8_tile_k_blocks = 4;
constexpr int fp8_window = 28;

__global__ void fp8_tile_bases_kernel(const std::int8_t* bytes, const std::int32_t* exponents, std::int64_t rows,
                                      std::int64_t blocks, std::int64_t stride, std::int32_t* bases,
                                      unsigned* too_wide) {
  const std::int64_t tiles = (rows + scaled_tile_rows - 1) / scaled_tile_rows;
  const std::int64_t k_tiles = (blocks + fp8_tile_k_blocks - 1) / fp8_tile_k_blocks;
  MXSCOPE_GRID_LOOP(t, tiles * blocks) {
    const std::int64_t tile = t / blocks;
    const std::int64_t b = t % blocks;
    int lowest = 1 << 30, highest = -(1 << 30);
    bool wide = false;
    for (std::int64_t row = tile * scaled_tile_rows; row < std::min<std::int64_t>(rows, (tile + 1) * scaled_tile_rows);
         ++row) {
      const std::int32_t e = exponents[b * rows + row];
      const uint4* const source = reinterpret_cast<const uint4*>(bytes + row * stride + 32 * b);
      const uint4 x = source[0], y = source[1];
      const bool nonzero = (x.x | x.y | x.z | x.w | y.x | y.y | y.z | y.w) != 0U;
      if (e == nan_block_exponent) wide = true;
      if (!nonzero || e == nan_block_exponent) continue;
      lowest = std::min(lowest, static_cast<int>(e));
      highest = std::max(highest, static_cast<int>(e));
    }
    int base = 0;
    if (lowest <= highest) {
      wide = wide || highest - lowest > fp8_window;
      base = std::min(std::max(0, highest - 13), lowest + 15);
    }
    bases[(tile * k_tiles + b / fp8_tile_k_blocks) * 4 + b % fp8_tile_k_blocks] = base;
    if (wide) atomicMax(too_wide, 1U);
  }
}

// The e5m2 bits of an fp32 number that is an e5m2 number (magnitude zero or in [2^-16, 57344]).
__device__ inline std::uint32_t exact_e5m2_bits(float value) {
  const std::uint32_t bits = core_ns::float_bits(value);
  const std::uint32_t sign = (bits >> 24) & 0x80U;
  const std::uint32_t magnitude = bits & 0x7FFFFFFFU;
  if (magnitude == 0U) return sign;
  const int exponent = static_cast<int>(magnitude >> 23) - 127;
  if (exponent >= -14) return sign | (static_cast<std::uint32_t>(exponent + 15) << 2) | ((magnitude >> 21) & 3U);
  // A subnormal: an integer multiple of 2^-16 below 2^-14.
  return sign | static_cast<std::uint32_t>(__fmul_rn(core_ns::bits_float(magnitude), 65536.0f));
}

__global__ void prepare_fp8_kernel(const std::int8_t* bytes, const std::int32_t* exponents, const std::int32_t* bases,
                                   std::int64_t rows, std::int64_t blocks, std::int64_t stride,
                                   unsigned char* tiles) {
  const std::int64_t k_tiles = (blocks + fp8_tile_k_blocks - 1) / fp8_tile_k_blocks;
  MXSCOPE_GRID_LOOP(t, rows * blocks) {
    const std::int64_t row = t / blocks;
    const std::int64_t b = t % blocks;
    const std::int64_t tile = row / scaled_tile_rows;
    const std::int64_t r = row % scaled_tile_rows;
    const int shift =
        exponents[b * rows + row] - bases[(tile * k_tiles + b / fp8_tile_k_blocks) * 4 + b % fp8_tile_k_blocks];
    const bool inside = shift >= -15 && shift <= 13;
    const float unit = core_ns::bits_float(static_cast<std::uint32_t>(inside ? shift - 1 + 127 : 127) << 23);
    const std::int8_t* const source = bytes + row * stride + 32 * b;
    unsigned char* const tile_row = tiles + (tile * k_tiles + b / fp8_tile_k_blocks) * scaled_tile_bytes + r * 128;
    for (int q = 0; q < 2; ++q) {  // the block's two 16-byte chunks: 2 (b mod 4) + q of the row
      std::uint32_t words[4];
      for (int w = 0; w < 4; ++w) {
        std::uint32_t word = 0;
        for (int h = 0; h < 4; ++h) {
          const int value = source[16 * q + 4 * w + h];
          const std::uint32_t code = inside ? exact_e5m2_bits(__fmul_rn(static_cast<float>(value), unit)) : 0U;
          word |= code << (8 * h);
        }
        words[w] = word;
      }
      const int chunk = static_cast<int>(2 * (b % fp8_tile_k_blocks)) + q;
      *reinterpret_cast<uint4*>(tile_row + swizzled_chunk(static_cast<int>(r), chunk)) =
          make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
}

}  // namespace

struct prepared_operand::storage {
  element_kind element = element_kind::fp4_e2m1;
  int block = 32;
  std::int64_t rows = 0;
  std::int64_t depth = 0;
  std::int64_t blocks = 0;
  std::int64_t byte_stride = 0;  // row stride of `bytes` (depth rounded up to 32)
  bool finite_elements = true;
  gemm_path path = gemm_path::generic;
  device_buffer elements;   // float [rows, depth] (generic)
  device_buffer integers;   // int32 [rows, depth] (integer)
  device_buffer bytes;      // int8 [rows, byte_stride] (tensor_core)
  device_buffer exponents;  // int32 [blocks, rows]
  std::int64_t padded_rows = 0;  // rows rounded up to tc_scale_row_pad (tensor_core)
  device_buffer scales;      // uint32 [blocks, padded_rows] (tensor_core; prepare_tensor_core_scales_kernel)
  device_buffer slow_tiles;  // unsigned [blocks, padded_rows / 128] (tensor_core)
  device_buffer scale_codes;  // uint8 e8m0 [padded rows, byte_stride / 16] (native_mfma; `bytes` holds fp4 codes)
  // The scaled kernel's bf16 operand (tensor_core, MXFP4, where that kernel exists) and the lowest
  // and highest block exponent over the blocks with a nonzero element (1000 and -1000: none).
  device_buffer scaled;  // bf16 in tiles (prepare_scaled_kernel)
  int scaled_lowest = 1000;
  int scaled_highest = -1000;
  bool scaled_nan = false;
  // The fp8 form (prepare_fp8_kernel), made with the bf16 one; fp8_fits: no tile spans more than
  // fp8_window exponents.
  device_buffer fp8;        // e5m2 in tiles
  device_buffer fp8_bases;  // int32 [row tiles][k tiles][4]
  bool fp8_fits = false;
  // sliced_block_kernel's form of `integers` (run_sliced_block), made by the first product that
  // needs it and kept for the next one with the same shift and padding (the same bytes): the
  // slices, the block scales and prepare_sliced_kernel's two flags.
  struct sliced_form {
    sliced_form(int shift_bits, std::int64_t padded_rows, std::size_t slice_bytes, std::size_t scale_bytes)
        : shift(shift_bits), padded(padded_rows), slices(slice_bytes), scales(scale_bytes) {}
    int shift;
    std::int64_t padded;
    scratch_buffer slices;  // kept for reuse once the operand goes
    scratch_buffer scales;
    unsigned flags[2] = {0, 0};
  };
  mutable std::mutex sliced_mutex;
  mutable std::optional<sliced_form> sliced;
};

prepared_operand::prepared_operand() : storage_(std::make_unique<storage>()) {}
prepared_operand::~prepared_operand() = default;
prepared_operand::prepared_operand(prepared_operand&&) noexcept = default;
prepared_operand& prepared_operand::operator=(prepared_operand&&) noexcept = default;
std::int64_t prepared_operand::rows() const { return storage_->rows; }
std::int64_t prepared_operand::depth() const { return storage_->depth; }

std::string_view gemm_path_name(gemm_path path) {
  switch (path) {
    case gemm_path::automatic:
      return "automatic";
    case gemm_path::generic:
      return "generic";
    case gemm_path::integer:
      return "integer";
    case gemm_path::tensor_core:
      return "tensor_core";
    case gemm_path::native_mfma:
      return "native_mfma";
  }
  return "?";
}

namespace {

constexpr int integer_max_group = 64;

bool integer_element(element_kind kind) {
  return kind != element_kind::e8m0 && kind != element_kind::ue4m3 && integer_max_of(kind) < (std::int64_t{1} << 31);
}

bool tensor_cores_present() {
#if defined(MXSCOPE_GPU_SIMULATE)
  return true;
#elif defined(MXSCOPE_CUDA_TENSOR_CORES)
  static const bool present = [] {
    const auto properties = current_device_properties();
    return properties && properties->major >= 8;
  }();
  return present;
#else
  return false;
#endif
}

bool wgmma_present();  // below, next to the kernels

// Whether the int8 warpgroup-MMA kernels run: on an sm_90 device from an sm_90a build, and in the
// CPU simulation, which emulates their MMA (not the scaled kernels' bf16 and e5m2 ones).
bool warpgroup_kernels_present() {
#if defined(MXSCOPE_GPU_SIMULATE)
  return true;
#else
  return wgmma_present();
#endif
}

// The selection functions' refusal: `what` kernel `name` is not in this build or on this device.
void require_kernel_available(bool available, const char* what, std::string_view name) {
  if (!available) {
    throw input_error(std::string("gpu gemm: the ") + what + " kernel " + std::string(name) +
                      " is not available in this build on this device");
  }
}

std::atomic<tensor_core_kernel> chosen_tensor_core_kernel{tensor_core_kernel::automatic};
std::atomic<tensor_core_kernel> last_run_tensor_core_kernel{tensor_core_kernel::automatic};

}  // namespace

std::string_view tensor_core_kernel_name(tensor_core_kernel kernel) {
  switch (kernel) {
    case tensor_core_kernel::automatic:
      return "automatic";
    case tensor_core_kernel::mma_sync:
      return "mma_sync";
    case tensor_core_kernel::wgmma:
      return "wgmma";
    case tensor_core_kernel::wgmma_bf16:
      return "wgmma_bf16";
    case tensor_core_kernel::wgmma_fp8:
      return "wgmma_fp8";
  }
  return "?";
}

bool tensor_core_kernel_available(tensor_core_kernel kernel) {
  switch (kernel) {
    case tensor_core_kernel::automatic:
    case tensor_core_kernel::mma_sync:
      return tensor_cores_present();
    case tensor_core_kernel::wgmma:
      return warpgroup_kernels_present();
    case tensor_core_kernel::wgmma_bf16:
    case tensor_core_kernel::wgmma_fp8:
      return wgmma_present();
  }
  return false;
}

void select_tensor_core_kernel(tensor_core_kernel kernel) {
  require_kernel_available(tensor_core_kernel_available(kernel), "tensor-core", tensor_core_kernel_name(kernel));
  chosen_tensor_core_kernel.store(kernel);
}

tensor_core_kernel selected_tensor_core_kernel() {
  const tensor_core_kernel kernel = chosen_tensor_core_kernel.load();
  if (kernel != tensor_core_kernel::automatic) return kernel;
  // The fastest on the H200 (BENCHMARKS.md).
  return wgmma_present() ? tensor_core_kernel::wgmma_fp8 : tensor_core_kernel::mma_sync;
}

tensor_core_kernel last_tensor_core_kernel() { return last_run_tensor_core_kernel.load(); }

bool gemm_path_covers(gemm_path path, element_kind a, element_kind b, int block, const accumulation_model& model) {
  const auto kind = model.kind;
  switch (path) {
    case gemm_path::automatic:
      return gemm_path_covers(gemm_path::generic, a, b, block, model);
    case gemm_path::generic:
      return kind == accumulation_kind::exact || kind == accumulation_kind::fp32_block ||
             kind == accumulation_kind::fp32_group || kind == accumulation_kind::fp32_seq;
    case gemm_path::integer:
      if (kind != accumulation_kind::exact && kind != accumulation_kind::fp32_block &&
          kind != accumulation_kind::fp32_group) {
        return false;
      }
      if (kind == accumulation_kind::fp32_group && model.blocks_per_group > integer_max_group) return false;
      return integer_element(a) && integer_element(b) && block_dot_bits(a, b, block) <= 53;
    case gemm_path::tensor_core:
      return tensor_cores_present() && (kind == accumulation_kind::fp32_block || kind == accumulation_kind::exact) &&
             block == 32 && tensor_core_element(a) && tensor_core_element(b);
    case gemm_path::native_mfma:
      return native_gfx950::gemm_fits(a, b, block, model) && native_gfx950::present();
  }
  return false;
}

gemm_path resolve_gemm_path(const mx_operand_view& a, const mx_operand_view& b, const accumulation_model& model) {
  for (const gemm_path path :
       {gemm_path::native_mfma, gemm_path::tensor_core, gemm_path::integer, gemm_path::generic}) {
    if (gemm_path_covers(path, a.element, b.element, a.block, model)) return path;
  }
  return gemm_path::generic;
}

prepared_operand prepare_operand(const mx_operand_view& operand, gemm_path path) {
  if (path == gemm_path::automatic) {
    throw input_error("gpu gemm: prepare_operand needs a concrete path (resolve_gemm_path gives one)");
  }
  if (operand.axis != 0 && operand.axis != 1) throw input_error("gpu gemm: field 'axis' must be 0 or 1");
  if (operand.block < 1) throw input_error("gpu gemm: field 'block' must be positive");
  if (path == gemm_path::integer && !integer_element(operand.element)) {
    throw input_error("gpu gemm: the integer path does not cover this element format");
  }
  if (path == gemm_path::tensor_core && (!tensor_core_element(operand.element) || operand.block != 32)) {
    throw input_error("gpu gemm: the tensor-core path needs block 32 and fp4, fp6 e2m3 or int8 elements");
  }
  if (path == gemm_path::native_mfma && (operand.element != element_kind::fp4_e2m1 || operand.block != 32)) {
    throw input_error("gpu gemm: the native_mfma path needs block 32 and fp4 elements");
  }
  prepared_operand out;
  auto& s = out.data();
  s.element = operand.element;
  s.block = operand.block;
  s.path = path;
  s.rows = operand.axis == 1 ? operand.rows : operand.cols;
  s.depth = operand.axis == 1 ? operand.cols : operand.rows;
  s.blocks = (s.depth + operand.block - 1) / operand.block;
  s.byte_stride = (s.depth + 31) / 32 * 32;
  if (path == gemm_path::native_mfma) {
    native_gfx950::prepare(operand, s);  // native_gfx950_product.hpp
    return out;
  }
  const std::int64_t count = s.rows * s.depth;
  float* elements = nullptr;
  std::int32_t* integers = nullptr;
  std::int8_t* bytes = nullptr;
  if (path == gemm_path::generic) {
    s.elements = device_buffer(static_cast<std::size_t>(count) * sizeof(float));
    elements = s.elements.as<float>();
  } else if (path == gemm_path::integer) {
    s.integers = device_buffer(static_cast<std::size_t>(count) * sizeof(std::int32_t));
    integers = s.integers.as<std::int32_t>();
  } else {
    s.bytes = device_buffer(static_cast<std::size_t>(s.rows * s.byte_stride));
    bytes = s.bytes.as<std::int8_t>();
  }
  s.exponents = device_buffer(static_cast<std::size_t>(s.blocks * s.rows) * sizeof(std::int32_t));
  // The nonfinite-element flag, prepare_scaled_kernel's range and fp8_tile_bases_kernel's flag: one
  // download for all.
  device_buffer flag(5 * sizeof(unsigned));
  flag.fill_bytes(0);
  const std::int64_t stride = path == gemm_path::tensor_core ? s.byte_stride : s.depth;
  if (s.rows > 0 && stride > 0 && operand.axis == 1) {
    // A few waves of resident blocks, each filling its code table once.
    const unsigned grid = std::min<unsigned>(grid_for(s.rows * stride), 16U * multiprocessor_count());
    runtime::launch(prepare_elements_kernel, grid, threads_per_block, 0, operand, s.rows, s.depth, stride,
                    fraction_bits_of(operand.element), elements, integers, bytes, flag.as<int>());
  } else if (s.rows > 0 && stride > 0) {
    const std::int64_t tiles =
        ((stride + prepare_tile - 1) / prepare_tile) * ((s.rows + prepare_tile - 1) / prepare_tile);
    const unsigned grid = std::min<unsigned>(grid_for(tiles, 1), 16U * multiprocessor_count());
    runtime::launch(prepare_elements_columns_kernel, grid, dim3(prepare_tile, prepare_tile_rows), 0,
                    operand, s.rows, s.depth, stride, fraction_bits_of(operand.element), elements, integers, bytes,
                    flag.as<int>());
  }
  if (s.rows > 0 && s.blocks > 0) {
    runtime::launch(prepare_exponents_kernel, grid_for(s.blocks * s.rows), threads_per_block, 0, operand, s.rows,
                    s.blocks, s.exponents.as<std::int32_t>());
  }
  if (path == gemm_path::tensor_core && s.rows > 0 && s.blocks > 0) {
    s.padded_rows = (s.rows + tc_scale_row_pad - 1) / tc_scale_row_pad * tc_scale_row_pad;
    s.scales = device_buffer(static_cast<std::size_t>(s.blocks * s.padded_rows) * sizeof(std::uint32_t));
    s.slow_tiles =
        device_buffer(static_cast<std::size_t>(s.blocks * (s.padded_rows / tc_flag_rows)) * sizeof(unsigned));
    s.slow_tiles.fill_bytes(0);
    runtime::launch(prepare_tensor_core_scales_kernel, grid_for(s.blocks * s.padded_rows), threads_per_block, 0,
                    s.exponents.as<const std::int32_t>(), s.rows, s.padded_rows, s.blocks,
                    fraction_bits_of(operand.element), s.scales.as<std::uint32_t>(), s.slow_tiles.as<unsigned>());
  }
#if defined(MXSCOPE_GPU_SIMULATE)
  constexpr bool scaled_kernels = true;  // no wgmma here, but the forms are made for tests to check
#else
  const bool scaled_kernels = wgmma_present();
#endif
  const bool scaled = path == gemm_path::tensor_core && s.element == element_kind::fp4_e2m1 && scaled_kernels &&
                      s.rows > 0 && s.blocks > 0;
  if (scaled) {
    // The bf16 form (rows of 64 k per tile), then the fp8 form (128 k) with its bases.
    const std::int64_t padded = (s.rows + scaled_row_pad - 1) / scaled_row_pad * scaled_row_pad;
    s.scaled = device_buffer(static_cast<std::size_t>(padded / scaled_tile_rows * ((s.blocks + 1) / 2)) *
                             scaled_tile_bytes);
    s.scaled.fill_bytes(0);
    runtime::launch(prepare_scaled_kernel, reduction_grid(s.rows * s.blocks), threads_per_block, 0,
                    s.bytes.as<const std::int8_t>(), s.exponents.as<const std::int32_t>(), s.rows, s.blocks,
                    s.byte_stride, s.scaled.as<unsigned char>(), flag.as<unsigned>() + 1);
    const std::int64_t k_tiles = (s.blocks + fp8_tile_k_blocks - 1) / fp8_tile_k_blocks;
    s.fp8 = device_buffer(static_cast<std::size_t>(padded / scaled_tile_rows * k_tiles) * scaled_tile_bytes);
    s.fp8.fill_bytes(0);
    s.fp8_bases =
        device_buffer(static_cast<std::size_t>(padded / scaled_tile_rows * k_tiles) * 4 * sizeof(std::int32_t));
    s.fp8_bases.fill_bytes(0);
    const std::int64_t tiles = (s.rows + scaled_tile_rows - 1) / scaled_tile_rows;
    runtime::launch(fp8_tile_bases_kernel, grid_for(tiles * s.blocks), threads_per_block, 0,
                    s.bytes.as<const std::int8_t>(), s.exponents.as<const std::int32_t>(), s.rows, s.blocks,
                    s.byte_stride, s.fp8_bases.as<std::int32_t>(), flag.as<unsigned>() + 4);
    runtime::launch(prepare_fp8_kernel, grid_for(s.rows * s.blocks), threads_per_block, 0,
                    s.bytes.as<const std::int8_t>(), s.exponents.as<const std::int32_t>(),
                    s.fp8_bases.as<const std::int32_t>(), s.rows, s.blocks, s.byte_stride, s.fp8.as<unsigned char>());
  }
  unsigned flags[5] = {};
  flag.download(flags, sizeof(flags));  // synchronizes
  s.finite_elements = flags[0] == 0;
  if (scaled) {
    s.scaled_lowest = flags[1] == 0 ? 1000 : static_cast<int>(scaled_range_offset) - static_cast<int>(flags[1]);
    s.scaled_highest = flags[2] == 0 ? -1000 : static_cast<int>(flags[2]) - static_cast<int>(scaled_range_offset);
    s.scaled_nan = flags[3] != 0;
    s.fp8_fits = flags[4] == 0;
  }
  return out;
}

scaled_operand_forms scaled_forms(const prepared_operand& operand) {
  const auto& s = operand.data();
  scaled_operand_forms forms;
  if (s.scaled.bytes() == 0) return forms;
  forms.made = true;
  forms.bf16.resize(s.scaled.bytes() / sizeof(std::uint16_t));
  s.scaled.download(forms.bf16.data(), s.scaled.bytes());
  forms.fp8.resize(s.fp8.bytes());
  s.fp8.download(forms.fp8.data(), s.fp8.bytes());
  forms.fp8_bases.resize(s.fp8_bases.bytes() / sizeof(std::int32_t));
  s.fp8_bases.download(forms.fp8_bases.data(), s.fp8_bases.bytes());
  forms.lowest = s.scaled_lowest;
  forms.highest = s.scaled_highest;
  forms.nan_block = s.scaled_nan;
  forms.fp8_fits = s.fp8_fits;
  return forms;
}

