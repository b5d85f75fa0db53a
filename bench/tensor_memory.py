"""Tensor memory at the allocator level: bytes live in PyTorch's CPU allocator, and their peak.

    from bench import tensor_memory as tm
    tm.install()                # once per process, before the tensors you want counted exist
    tm.reset_peak()             # peak := bytes live now
    step()
    print(tm.peak_bytes(), tm.live_bytes())

``install`` puts a counting wrapper in front of the CPU allocator (``c10::SetCPUAllocator``, a
small C++ extension built once per machine by ``torch.utils.cpp_extension``): every CPU tensor
allocated afterwards, from Python, ATen, oneDNN through ATen, Inductor's generated code or Kiln's
launcher and kernels' outputs, adds its requested size to a live counter when it is allocated and
subtracts it when its storage is freed.  Tensors that existed before ``install`` are not counted
(their storages keep their own allocator), nor is memory outside the allocator (Python objects,
code, oneDNN scratch buffers, malloc's own overhead): that is what process RSS shows besides.

The counting allocator hands each request to the allocator it replaced, so the memory itself and
its behaviour (alignment, huge pages, profiler reports) are unchanged.  It cannot be removed again:
use it in a process (or forked child) made for measuring.
"""

from __future__ import annotations

import functools
from types import ModuleType

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>

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
"""

_FUNCTIONS = ["install", "active", "live_bytes", "peak_bytes", "allocations", "reset_peak"]


class Unavailable(RuntimeError):
    """The counting allocator could not be built or installed (the reason is in the message)."""


@functools.lru_cache(maxsize=1)
def _ext() -> ModuleType:
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load_inline(
            "kiln_bench_tensor_memory",
            cpp_sources=_SOURCE,
            functions=_FUNCTIONS,
            extra_cflags=["-O2"],
            verbose=False,
        )
    except Exception as e:  # re-raised with what to do about it
        raise Unavailable(
            f"building the counting CPU allocator failed ({type(e).__name__}: "
            f"{str(e).strip()[:300]}); it needs g++ and ninja as torch.utils.cpp_extension does"
        ) from e


def load() -> None:
    """Build (first time on this machine) and load the extension without installing it."""
    _ext()


def install() -> None:
    """Count every CPU tensor allocated from now on (idempotent)."""
    m = _ext()
    m.install()
    if not m.active():
        raise Unavailable("another CPU allocator with a higher priority is installed")


def live_bytes() -> int:
    return int(_ext().live_bytes())


def peak_bytes() -> int:
    """The most bytes live at once since ``install`` or the last ``reset_peak``."""
    return int(_ext().peak_bytes())


def allocations() -> int:
    return int(_ext().allocations())


def reset_peak() -> None:
    _ext().reset_peak()


def active() -> bool:
    """Whether the counting allocator is the CPU allocator now."""
    return bool(_ext().active())
