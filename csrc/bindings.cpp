// pybind11 bindings of the core. Memory leaves as DLPack capsules (dlpack_export.cpp), so the
// extension neither includes nor links torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "backend.h"
#include "dlpack.h"
#include "dlpack_export.h"
#include "errors.h"
#include "region.h"
#include "registry.h"

namespace py = pybind11;
using namespace colo;

namespace {

void raise_colo_error(const char* python_name, PyObject* fallback, const char* message) {
  try {
    py::object type = py::module_::import("colo.errors").attr(python_name);
    PyErr_SetString(type.ptr(), message);
  } catch (...) {
    PyErr_SetString(fallback, message);
  }
}

py::dict stats_dict(const RegionStats& s) {
  py::dict d;
  d["budget_bytes"] = s.budget_bytes;
  d["virtual_bytes"] = s.virtual_bytes;
  d["chunk_bytes"] = s.chunk_bytes;
  d["allocated_bytes"] = s.allocated_bytes;
  d["pending_free_bytes"] = s.pending_free_bytes;
  d["peak_allocated_bytes"] = s.peak_allocated_bytes;
  d["committed_bytes"] = s.committed_bytes;
  d["resident_bytes"] = s.resident_bytes;
  d["offloaded_bytes"] = s.offloaded_bytes;
  d["offload_buffer_bytes"] = s.offload_buffer_bytes;
  d["num_allocations"] = s.num_allocations;
  d["largest_free_block"] = s.largest_free_block;
  d["sleep_count"] = s.sleep_count;
  d["last_sleep_seconds"] = s.last_sleep_seconds;
  d["last_wake_seconds"] = s.last_wake_seconds;
  d["asleep"] = s.asleep;
  return d;
}

StreamRole parse_role(const std::string& role) {
  if (role == "train") return StreamRole::kTrain;
  if (role == "infer") return StreamRole::kInfer;
  if (role == "copy") return StreamRole::kCopy;
  throw InvalidArgument("unknown stream role '" + role + "' (expected 'train', 'infer' or 'copy')");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "colo's compiled core: memory backends, regions, streams (no torch inside; DLPack out)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OutOfMemory& e) {
      raise_colo_error("OutOfMemoryError", PyExc_MemoryError, e.what());
    } catch (const RegionAsleep& e) {
      raise_colo_error("RegionAsleepError", PyExc_RuntimeError, e.what());
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const SystemError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  py::class_<Event, std::shared_ptr<Event>>(m, "Event")
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("query", &Event::query);

  py::class_<Stream, std::shared_ptr<Stream>>(m, "Stream")
      .def(
          "copy_batch",
          [](Stream& s, const std::vector<std::tuple<uintptr_t, uintptr_t, size_t>>& copies) {
            std::vector<CopyOp> ops;
            ops.reserve(copies.size());
            for (const auto& [dst, src, bytes] : copies) {
              ops.push_back({reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes});
            }
            py::gil_scoped_release release;
            s.copy_batch(ops);
          },
          "Enqueue byte copies [(dst_ptr, src_ptr, bytes), ...] as one batch; returns at once.")
      .def("record", &Stream::record)
      .def("wait", &Stream::wait)
      .def("synchronize", &Stream::synchronize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("native_handle", &Stream::native_handle);

  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def_property_readonly("name", &Backend::name)
      .def_property_readonly("device_type",
                             [](const Backend& b) { return b.device_kind() == DeviceKind::kCuda ? "cuda" : "cpu"; })
      .def_property_readonly("device_index", &Backend::device_index)
      .def_property_readonly("granularity", [](const Backend& b) { return b.memory().granularity(); })
      .def_property_readonly("commits_zeroed", [](const Backend& b) { return b.memory().commits_zeroed(); })
      .def("create_stream",
           [](Backend& b, const std::string& role) { return b.streams().create_stream(parse_role(role)); })
      .def(
          "synchronize_device", [](Backend& b) { b.streams().synchronize_device(); },
          py::call_guard<py::gil_scoped_release>());

  m.def("make_host_backend", &make_host_backend, py::arg("kind") = "anon");
  m.def("make_cuda_backend", &make_cuda_backend, py::arg("index") = 0);

  py::class_<Region, std::shared_ptr<Region>>(m, "Region")
      .def(py::init<std::shared_ptr<Backend>, std::string, size_t, size_t, size_t>(), py::arg("backend"),
           py::arg("name"), py::arg("budget_bytes"), py::arg("chunk_bytes") = 0, py::arg("alignment") = 256)
      .def_property_readonly("name", &Region::name)
      .def_property_readonly("asleep", &Region::asleep)  // cheap, unlike stats() (resident bytes)
      .def_property_readonly("budget_bytes", &Region::budget)
      .def_property_readonly("alignment", &Region::alignment)
      .def("allocate", [](Region& r, size_t bytes) { return reinterpret_cast<uintptr_t>(r.allocate(bytes)); })
      .def("free", [](Region& r, uintptr_t ptr) { r.free(reinterpret_cast<void*>(ptr)); })
      .def("allocate_dlpack", &allocate_dlpack, py::arg("bytes"), py::arg("shape"), py::arg("code") = static_cast<uint8_t>(kDLUInt),
           py::arg("bits") = static_cast<uint8_t>(8), py::arg("stream") = py::none())
      .def("contains", [](const Region& r, uintptr_t ptr) { return r.contains(reinterpret_cast<void*>(ptr)); })
      .def("sleep", &Region::sleep, py::arg("offload") = false, py::call_guard<py::gil_scoped_release>())
      .def("wake", &Region::wake, py::arg("fault_in") = true, py::call_guard<py::gil_scoped_release>())
      .def("trim", &Region::trim, py::call_guard<py::gil_scoped_release>())
      .def("set_budget", &Region::set_budget, py::arg("bytes"))
      .def("stats", [](const Region& r) { return stats_dict(r.stats()); });

  m.def("set_current_region", &set_current_region, py::arg("device"), py::arg("region"));
  m.def("current_region", &current_region, py::arg("device"));

  m.def("probe_cuda", [] {
    CudaProbe p = probe_cuda();
    py::dict d;
    d["compiled"] = p.compiled;
    d["available"] = p.available;
    d["device_count"] = p.device_count;
    d["driver_version"] = p.driver_version;
    d["reason"] = p.reason;
    return d;
  });

  m.def("build_info", [] {
    py::dict d;
    bool cuda = probe_cuda().compiled;
    py::list backends;
    backends.append("host-anon");
    backends.append("host-memfd");
    if (cuda) backends.append("cuda-vmm");
    d["backends"] = backends;
    d["cuda_compiled"] = cuda;
    d["cuda_version"] = std::string(COLO_CUDA_VERSION);
    d["compiler"] = std::string(COLO_COMPILER);
    d["sanitizer"] = std::string(COLO_SANITIZER);
    d["torch_allocator_symbols"] = py::make_tuple("colo_torch_alloc", "colo_torch_free");
    return d;
  });
}
