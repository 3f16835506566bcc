// Region memory handed to Python as DLPack "dltensor" capsules, so the extension neither includes
// nor links torch; colo/pool.py turns them into tensors with torch.from_dlpack.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "region.h"

namespace colo {

// A compact tensor of `shape` and DLPack dtype (code, bits) in `region`, `bytes` long. `stream`
// (CUDA: a CUstream, 0 the legacy default stream) orders its free after the work queued there by
// then (Region::free_after); without one the memory is reusable as soon as the tensor dies.
pybind11::capsule allocate_dlpack(const std::shared_ptr<Region>& region, size_t bytes, std::vector<int64_t> shape,
                                  uint8_t code, uint8_t bits, std::optional<uintptr_t> stream);

}  // namespace colo
