// Exception types of the core and the macros that raise them with file:line (as RMM_EXPECTS does).
// bindings.cpp translates each type to its Python exception (colo.errors).
#pragma once
#include <stdexcept>
#include <string>

namespace colo {

// A request that does not fit the region's budget or free space. Maps to colo.OutOfMemoryError.
struct OutOfMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Allocation in a region whose physical memory is released. Maps to colo.RegionAsleepError.
struct RegionAsleep : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Bad argument from the caller. Maps to ValueError.
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// The operating system or the CUDA driver refused. Maps to RuntimeError.
struct SystemError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace colo

#define COLO_STRINGIFY_(x) #x
#define COLO_STRINGIFY(x) COLO_STRINGIFY_(x)
#define COLO_WHERE __FILE__ ":" COLO_STRINGIFY(__LINE__)

// Raise `Kind` with `message` when `condition` does not hold.
#define COLO_EXPECTS(condition, Kind, message)                                   \
  do {                                                                           \
    if (!(condition)) throw Kind(std::string(message) + " (" COLO_WHERE ")");    \
  } while (0)

// Raise colo::SystemError carrying errno's text when a libc call returns -1 / MAP_FAILED.
#define COLO_SYSCALL(ok, what)                                                         \
  do {                                                                                 \
    if (!(ok)) {                                                                       \
      int err_ = errno;                                                                \
      throw ::colo::SystemError(std::string(what) + " failed: " + std::strerror(err_) + \
                                " (" COLO_WHERE ")");                                  \
    }                                                                                  \
  } while (0)
