#include "dlpack_export.h"

#include "dlpack.h"
#include "errors.h"

namespace py = pybind11;

namespace colo {
namespace {

// One tensor's worth of ownership: the region stays alive while torch holds the memory.
struct TensorContext {
  std::shared_ptr<Region> region;
  void* ptr = nullptr;
  std::optional<uintptr_t> stream;  // CUDA: where the tensor is used; its free waits for that work
  std::vector<int64_t> shape;
  DLManagedTensor managed{};
};

void delete_tensor(DLManagedTensor* self) {
  auto* ctx = static_cast<TensorContext*>(self->manager_ctx);
  try {
    if (ctx->stream) {
      ctx->region->free_after(ctx->ptr, *ctx->stream);
    } else {
      ctx->region->free(ctx->ptr);
    }
  } catch (...) {
    // Called from torch's deleter, which cannot take an exception; the block leaks rather than crash.
  }
  delete ctx;
}

void destroy_unconsumed_capsule(PyObject* capsule) {
  // torch renames a consumed capsule to "used_dltensor" and then owns the memory.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    managed->deleter(managed);
  }
}

}  // namespace

py::capsule allocate_dlpack(const std::shared_ptr<Region>& region, size_t bytes, std::vector<int64_t> shape,
                            uint8_t code, uint8_t bits, std::optional<uintptr_t> stream) {
  int64_t numel = 1;
  for (int64_t n : shape) {
    COLO_EXPECTS(n >= 0, InvalidArgument, "tensor shape entries must be non-negative");
    numel *= n;
  }
  COLO_EXPECTS(static_cast<size_t>(numel) * bits / 8 == bytes, InvalidArgument,
               "tensor shape and dtype do not match the byte count");
  auto* ctx = new TensorContext();
  try {
    ctx->ptr = region->allocate(bytes);
  } catch (...) {
    delete ctx;
    throw;
  }
  ctx->region = region;
  ctx->stream = stream;
  ctx->shape = std::move(shape);
  DLTensor& t = ctx->managed.dl_tensor;
  t.data = ctx->ptr;
  bool cuda = region->backend().device_kind() == DeviceKind::kCuda;
  t.device = {cuda ? kDLCUDA : kDLCPU, cuda ? region->backend().device_index() : 0};
  t.ndim = static_cast<int32_t>(ctx->shape.size());
  t.dtype = {code, bits, 1};
  t.shape = ctx->shape.data();
  t.strides = nullptr;  // compact
  t.byte_offset = 0;
  ctx->managed.manager_ctx = ctx;
  ctx->managed.deleter = delete_tensor;
  PyObject* capsule = PyCapsule_New(&ctx->managed, "dltensor", destroy_unconsumed_capsule);
  if (!capsule) {
    delete_tensor(&ctx->managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(capsule);
}

}  // namespace colo
