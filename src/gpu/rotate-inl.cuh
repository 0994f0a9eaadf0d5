// Part of quantize.cu (included there, in order, inside namespace mxscope::gpu):
// the Hadamard rotations.
// ================================================================================================
// Rotations (NUMERICS.md section 5).
//
// One thread block holds `lines` segments of one rotation block in shared memory and runs the
// canonical stages h = 1, 2, ..., size/2 with a barrier between stages. Within a stage the
// butterflies touch disjoint pairs, so splitting them over threads changes no bit: each output is
// fl32(a + c) or fl32(a - c) of the same inputs as on the CPU. Signs multiply first (exact), the
// scale fl32(1/sqrt(b)) last, as core::rotate_segment does.

namespace {

__global__ void rotation_signs_kernel(float* signs, std::int64_t length, core_ns::random_stream stream) {
  MXSCOPE_GRID_LOOP(k, length) { signs[k] = core_ns::sign_from_word(stream.word(static_cast<std::uint64_t>(k))); }
}

constexpr int rotation_tile_elements = 2048;

__global__ void rotate_kernel(float* values, std::int64_t rows, std::int64_t cols, int axis, int size,
                              const float* signs) {
  MXSCOPE_DYNAMIC_SHARED(float, tile);  // [lines][size]
  const bool along_rows = axis == 1;
  const std::int64_t line_count = along_rows ? rows : cols;
  const std::int64_t length = along_rows ? cols : rows;
  const std::int64_t segments = length / size;
  const int lines = size >= rotation_tile_elements ? 1 : rotation_tile_elements / size;
  const std::int64_t line_groups = (line_count + lines - 1) / lines;
  const std::int64_t segment = static_cast<std::int64_t>(blockIdx.x) % segments;
  const std::int64_t first_line = (static_cast<std::int64_t>(blockIdx.x) / segments) * lines;
  if (first_line >= line_groups * lines) return;
  const int elements = lines * size;
  const std::int64_t begin = segment * size;

  // Load: for axis 1 consecutive threads walk along a row; for axis 0 across the lines (columns).
  for (int t = threadIdx.x; t < elements; t += blockDim.x) {
    const int line = along_rows ? t / size : t % lines;
    const int i = along_rows ? t % size : t / lines;
    const std::int64_t global_line = first_line + line;
    float value = 0.0f;
    if (global_line < line_count) {
      const std::int64_t index = along_rows ? global_line * cols + begin + i : (begin + i) * cols + global_line;
      value = values[index];
      if (signs != nullptr) value = value * signs[begin + i];
    }
    tile[line * size + i] = value;
  }
  const int half_size = size / 2;
  for (int half = 1; half < size; half *= 2) {
    __syncthreads();
    for (int p = threadIdx.x; p < lines * half_size; p += blockDim.x) {
      const int line = p / half_size;
      const int q = p % half_size;
      const int j = (q / half) * 2 * half + q % half;
      float* base = tile + line * size;
      const float a = base[j];
      const float c = base[j + half];
      base[j] = a + c;
      base[j + half] = a - c;
    }
  }
  __syncthreads();
  const float scale = core_ns::hadamard_scale(size);
  for (int t = threadIdx.x; t < elements; t += blockDim.x) {
    const int line = along_rows ? t / size : t % lines;
    const int i = along_rows ? t % size : t / lines;
    const std::int64_t global_line = first_line + line;
    if (global_line < line_count) {
      const std::int64_t index = along_rows ? global_line * cols + begin + i : (begin + i) * cols + global_line;
      values[index] = tile[line * size + i] * scale;
    }
  }
}

// Rotations of 16 and 32 along the columns (axis 0, the Wgrad operands' blocking): one thread per
// segment, the segment in registers through core::rotate_segment itself, no shared memory or
// barriers; consecutive threads take consecutive columns, so each of a segment's loads and stores
// is coalesced. rotate_kernel's shared tile, with a barrier per stage, stays for the other sizes
// and axis 1 (BENCHMARKS.md, "The step's small kernels and the slots from huge pages").
template <int Size>
__global__ void rotate_columns_kernel(float* values, std::int64_t rows, std::int64_t cols, const float* signs) {
  const std::int64_t segments = rows / Size;
  MXSCOPE_GRID_LOOP(t, segments * cols) {
    const std::int64_t begin = (t / cols) * Size;  // the segment's first row
    float* const first = values + begin * cols + t % cols;
    float v[Size];
    float s[Size];
#pragma unroll
    for (int i = 0; i < Size; ++i) {
      v[i] = first[i * cols];
      s[i] = signs != nullptr ? signs[begin + i] : 1.0f;
    }
    core_ns::rotate_segment(v, Size, signs != nullptr ? s : nullptr);
#pragma unroll
    for (int i = 0; i < Size; ++i) first[i * cols] = v[i];
  }
}

// The sign vector of a rotation along an axis of `length` positions, or an empty buffer for none.
device_buffer make_signs(const rotation_plan& rotation, std::int64_t length) {
  if (rotation.size == 0 || !rotation.random_signs || length == 0) return {};
  device_buffer signs(static_cast<std::size_t>(length) * sizeof(float));
  runtime::launch(rotation_signs_kernel, grid_for(length), threads_per_block, 0, signs.as<float>(), length,
                  rotation.signs);
  return signs;
}

void launch_rotate(float* values, std::int64_t rows, std::int64_t cols, int axis, int size, const float* signs) {
  const std::int64_t line_count = axis == 1 ? rows : cols;
  const std::int64_t length = axis == 1 ? cols : rows;
  if (line_count == 0 || length == 0) return;
  if (axis == 0 && (size == 16 || size == 32)) {
    const std::int64_t threads = (rows / size) * cols;
    if (size == 16) {
      runtime::launch(rotate_columns_kernel<16>, grid_for(threads), threads_per_block, 0, values, rows, cols, signs);
    } else {
      runtime::launch(rotate_columns_kernel<32>, grid_for(threads), threads_per_block, 0, values, rows, cols, signs);
    }
    return;
  }
  const int lines = size >= rotation_tile_elements ? 1 : rotation_tile_elements / size;
  const std::int64_t line_groups = (line_count + lines - 1) / lines;
  const std::int64_t grid = line_groups * (length / size);
  if (grid > 0x7fffffffLL) throw gpu_error("rotate: tensor too large for one launch");
  const std::size_t shared_bytes = static_cast<std::size_t>(lines) * size * sizeof(float);
  runtime::launch(rotate_kernel, static_cast<unsigned>(grid), threads_per_block, shared_bytes, values, rows, cols, axis,
                  size, signs);
}

}  // namespace

void rotate_on_device(float* values, std::int64_t rows, std::int64_t cols, int axis, const rotation_plan& rotation) {
  check_rotation(rotation, rows, cols, axis);
  if (rotation.size == 0) return;
  const std::int64_t length = axis == 1 ? cols : rows;
  const device_buffer signs = make_signs(rotation, length);
  launch_rotate(values, rows, cols, axis, rotation.size, signs.as<const float>());
  if (signs.get() != nullptr) release_after_kernels();  // `signs` must outlive the kernel
}

