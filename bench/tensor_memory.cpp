// The counting CPU allocator of bench/tensor_memory.py (which says what it counts).  Only c10's
// allocator API and pybind11: torch/extension.h would take g++ four times as long to compile.
#include <c10/core/CPUAllocator.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace {

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocs{0};

struct Block {
  int64_t bytes;
  void* ctx;  // the replaced allocator's context and deleter for this allocation
  c10::DeleterFnPtr deleter;
};

// data pointer -> its block: our DataPtrs are "simple" (context == data), as the default CPU
// allocator's are, so raw_allocate / raw_deallocate (used inside ATen) work through this one too
std::mutex g_mutex;
std::unordered_map<void*, Block> g_blocks;

void note_peak(int64_t v) {
  int64_t p = g_peak.load(std::memory_order_relaxed);
  while (v > p && !g_peak.compare_exchange_weak(p, v, std::memory_order_relaxed)) {
  }
}

c10::DeleterFnPtr g_inner_raw_deleter = nullptr;

void release(void* data) {
  Block b;
  {
    std::lock_guard<std::mutex> guard(g_mutex);
    auto it = g_blocks.find(data);
    if (it == g_blocks.end()) {
      // raw memory the replaced allocator gave out before install, freed through the CPU
      // allocator that is current now: its own raw deleter frees it (never counted)
      TORCH_CHECK(g_inner_raw_deleter != nullptr, "counting allocator: unknown pointer");
      g_inner_raw_deleter(data);
      return;
    }
    b = it->second;
    g_blocks.erase(it);
  }
  g_live.fetch_sub(b.bytes, std::memory_order_relaxed);
  if (b.deleter != nullptr) b.deleter(b.ctx);
}

struct CountingAllocator final : c10::Allocator {
  explicit CountingAllocator(c10::Allocator* a) : inner(a) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr d = inner->allocate(n);
    void* data = d.get();
    if (data == nullptr) return d;  // zero bytes: nothing to count
    const c10::Device dev = d.device();
    Block b{static_cast<int64_t>(n), nullptr, d.get_deleter()};
    b.ctx = d.release_context();
    {
      std::lock_guard<std::mutex> guard(g_mutex);
      g_blocks[data] = b;
    }
    note_peak(g_live.fetch_add(b.bytes, std::memory_order_relaxed) + b.bytes);
    g_allocs.fetch_add(1, std::memory_order_relaxed);
    return {data, data, &release, dev};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner->copy_data(dest, src, count);
  }
  c10::Allocator* inner;
};

CountingAllocator* g_alloc = nullptr;

}  // namespace

bool install() {
  if (g_alloc != nullptr) return false;
  g_alloc = new CountingAllocator(c10::GetCPUAllocator());  // lives as long as the process
  g_inner_raw_deleter = g_alloc->inner->raw_deleter();
  c10::SetCPUAllocator(g_alloc, /*priority=*/255);
  return true;
}
bool active() { return g_alloc != nullptr && c10::GetCPUAllocator() == g_alloc; }
int64_t live_bytes() { return g_live.load(); }
int64_t peak_bytes() { return g_peak.load(); }
int64_t allocations() { return g_allocs.load(); }
void reset_peak() { g_peak.store(g_live.load()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("active", &active);
  m.def("live_bytes", &live_bytes);
  m.def("peak_bytes", &peak_bytes);
  m.def("allocations", &allocations);
  m.def("reset_peak", &reset_peak);
}
