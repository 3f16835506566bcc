// Process-wide bookkeeping for the torch pluggable-allocator entry points: which region is current
// for each device (set by `pool.use(name)`), and which region owns an address (for frees, which may
// come after the `use` block has ended).
#pragma once
#include <memory>

#include "region.h"

namespace colo {

// One current region per device, shared by every thread of the process (not per thread): torch's
// MemPool routes only the allocating thread's requests here, but whichever thread's `pool.use`
// set the device's region last is the one all of them allocate in.
void set_current_region(int device, std::shared_ptr<Region> region);  // nullptr clears
std::shared_ptr<Region> current_region(int device);
// Regions ever made current stay alive until exit: torch may free their blocks at any time.
std::shared_ptr<Region> region_owning(const void* ptr);

}  // namespace colo
