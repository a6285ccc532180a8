// A CPU allocator for large tensors that keeps the memory they free for the next ones.
//
// torch's default CPU allocator hands a large tensor back to the C library when it is
// freed, and the C library gives it to the kernel (a mapping of its own, or a trimmed heap).
// The next large tensor is then faulted in and zeroed page by page, and on a VM that
// reports free pages to its host (virtio-balloon free page reporting) each page that sat
// free for a few seconds is faulted in by the host too: 0.3-1.5 s per GiB (see
// benchmark/refault.py).  A model worker frees and retakes gigabytes per call.
//
// The pool serves tensors of at least `min_bytes` from one reserved range of addresses,
// best fit (the smallest free block that holds it, the lowest address among equal sizes),
// and coalesces a freed block with its free neighbours.  Memory it has touched stays in the
// process until trim() gives its free blocks back.  Smaller tensors, and any the range
// cannot hold, go to the allocator it replaced, whose deleter frees them.
#include <sys/mman.h>
#include <unistd.h>

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "kernels.h"

namespace realhf {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHuge = size_t(2) << 20;  // the range starts on a huge-page boundary

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

class TensorPool final : public c10::Allocator {
 public:
  TensorPool(c10::Allocator* fallback, size_t min_bytes, uintptr_t base, size_t size)
      : fallback_(fallback), min_bytes_(min_bytes), base_(base), end_(base + size), high_(base) {
    add_free(base, size);
  }

  c10::DataPtr allocate(size_t n) override {
    if (n >= min_bytes_) {
      const size_t size = round_up(n, kPage);
      std::lock_guard<std::mutex> lock(mu_);
      auto it = by_size_.lower_bound({size, 0});
      if (it != by_size_.end()) {
        const auto [block, addr] = *it;
        by_size_.erase(it);
        by_addr_.erase(addr);
        if (block > size) add_free(addr + size, block - size);
        live_.emplace(addr, size);
        live_bytes_ += size;
        high_ = std::max(high_, addr + size);
        void* p = reinterpret_cast<void*>(addr);
        return {p, p, &TensorPool::free_block, c10::Device(c10::DeviceType::CPU)};
      }
      ++fallbacks_;  // the range is full: the replaced allocator serves it
    }
    return fallback_->allocate(n);
  }

  // For raw_allocate: a pool block is known by its address, anything else is the
  // replaced allocator's.
  c10::DeleterFnPtr raw_deleter() const override {
    return fallback_->raw_deleter() == nullptr ? nullptr : &TensorPool::raw_free;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void free_block(void* p);
  static void raw_free(void* p);

  bool owns(const void* p) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    return a >= base_ && a < end_;
  }

  void release(uintptr_t addr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(addr);
    if (it == live_.end()) throw std::logic_error("tensor_pool: freeing a block it does not hold");
    size_t size = it->second;
    live_.erase(it);
    live_bytes_ -= size;
    auto next = by_addr_.find(addr + size);
    if (next != by_addr_.end()) {
      size += next->second;
      remove_free(next);
    }
    auto prev = by_addr_.lower_bound(addr);
    if (prev != by_addr_.begin()) {
      --prev;
      if (prev->first + prev->second == addr) {
        addr = prev->first;
        size += prev->second;
        remove_free(prev);
      }
    }
    add_free(addr, size);
  }

  // Give the pages of every free block back to the system; returns the bytes given back.
  size_t trim() {
    std::lock_guard<std::mutex> lock(mu_);
    size_t given = 0;
    for (const auto& [addr, size] : by_addr_) {
      const uintptr_t a = round_up(addr, kPage), b = std::min(addr + size, high_);
      if (b <= a) continue;
      if (madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED) == 0) given += b - a;
    }
    // Nothing above the highest live block has been touched since.
    high_ = base_;
    for (const auto& [addr, size] : live_) high_ = std::max(high_, addr + size);
    return given;
  }

  std::map<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {{"live_bytes", int64_t(live_bytes_)},
            {"live_blocks", int64_t(live_.size())},
            {"touched_bytes", int64_t(high_ - base_)},
            {"free_blocks", int64_t(by_addr_.size())},
            {"reserved_bytes", int64_t(end_ - base_)},
            {"min_bytes", int64_t(min_bytes_)},
            {"fallbacks", int64_t(fallbacks_)}};
  }

 private:
  using FreeIt = std::map<uintptr_t, size_t>::iterator;
  void add_free(uintptr_t addr, size_t size) {
    by_addr_.emplace(addr, size);
    by_size_.emplace(size, addr);
  }
  void remove_free(FreeIt it) {
    by_size_.erase({it->second, it->first});
    by_addr_.erase(it);
  }

  c10::Allocator* const fallback_;
  const size_t min_bytes_;
  const uintptr_t base_, end_;
  uintptr_t high_;  // end of the highest block handed out since the last trim
  std::mutex mu_;
  std::map<uintptr_t, size_t> by_addr_;             // free blocks by address
  std::set<std::pair<size_t, uintptr_t>> by_size_;  // the same, by (size, address)
  std::unordered_map<uintptr_t, size_t> live_;      // blocks handed out
  size_t live_bytes_ = 0;
  int64_t fallbacks_ = 0;
};

// Never destroyed: tensors may outlive every static (the interpreter's exit).
TensorPool* g_pool = nullptr;
std::mutex g_install_mu;

void TensorPool::free_block(void* p) { g_pool->release(reinterpret_cast<uintptr_t>(p)); }

void TensorPool::raw_free(void* p) {
  if (g_pool->owns(p))
    g_pool->release(reinterpret_cast<uintptr_t>(p));
  else
    g_pool->fallback_->raw_deleter()(p);
}

}  // namespace

bool tensor_pool_install(int64_t reserve_bytes, int64_t min_bytes) {
  std::lock_guard<std::mutex> lock(g_install_mu);
  if (g_pool != nullptr) return false;
  TORCH_CHECK(reserve_bytes > 0 && min_bytes > 0,
              "tensor_pool_install: reserve_bytes and min_bytes must be > 0");
  // Addresses only: MAP_NORESERVE commits nothing, and a page uses memory once touched.
  const size_t size = round_up(size_t(reserve_bytes), kHuge);
  void* p = mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "tensor_pool_install: could not reserve ", size,
              " bytes of addresses (mmap failed); a smaller reserve_bytes may fit");
  const uintptr_t base = round_up(reinterpret_cast<uintptr_t>(p), kHuge);
  g_pool = new TensorPool(c10::GetCPUAllocator(), size_t(min_bytes), base, size);
  // Above the default allocator's priority: later registrations at 0 do not displace it.
  c10::SetCPUAllocator(g_pool, /*priority=*/100);
  return true;
}

int64_t tensor_pool_trim() { return g_pool == nullptr ? 0 : int64_t(g_pool->trim()); }

std::map<std::string, int64_t> tensor_pool_stats() {
  return g_pool == nullptr ? std::map<std::string, int64_t>{} : g_pool->stats();
}

}  // namespace realhf
