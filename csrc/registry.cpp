#include "registry.h"

#include <map>
#include <mutex>
#include <vector>

namespace colo {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<int, std::shared_ptr<Region>>& current_by_device() {
  static auto* m = new std::map<int, std::shared_ptr<Region>>();  // leaked on purpose: outlives torch's frees at exit
  return *m;
}
std::vector<std::shared_ptr<Region>>& known_regions() {
  static auto* v = new std::vector<std::shared_ptr<Region>>();
  return *v;
}

}  // namespace

void set_current_region(int device, std::shared_ptr<Region> region) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  if (region) {
    bool known = false;
    for (const auto& r : known_regions()) known = known || r == region;
    if (!known) known_regions().push_back(region);
    current_by_device()[device] = std::move(region);
  } else {
    current_by_device().erase(device);
  }
}

std::shared_ptr<Region> current_region(int device) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = current_by_device().find(device);
  return it == current_by_device().end() ? nullptr : it->second;
}

std::shared_ptr<Region> region_owning(const void* ptr) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (const auto& r : known_regions()) {
    if (r->contains(ptr)) return r;
  }
  return nullptr;
}

}  // namespace colo
