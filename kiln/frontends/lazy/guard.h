// The kiln device's guard in C++: what PyTorch's autograd engine and device guards call for a
// tensor on the kiln device (PrivateUse1), without calling into Python.  Self-contained: built
// alone as the device guard extension (guard.cpp, loaded at the device's first use, see
// lazy/device_guard.py) and included in the native recorder's translation unit.
//
// The kiln device first registers PyTorch's Python device guard (torch._C._acc.DeviceGuard, see
// lazy/device.py).  Its stream functions are `noexcept` but each asks the Python object for the
// device type.  The autograd engine holds a stream guard on a kiln node while it runs the node
// and its hooks; when a Python hook or function raises there (GradientSync's post-accumulate
// hook when an all-reduce fails, any user hook), the engine unwinds with the Python error still
// pending, the guard's destructor calls `exchangeStream`, the Python call fails because an error
// is pending, and the throw out of a `noexcept` function ends the process (std::terminate:
// "terminate called without an active exception", SIGABRT) instead of raising the error from
// `backward()`.  This guard does what the Python one does -- one device, index 0, its default
// stream, no events -- in C++, so nothing in it can fail.  `install_device_guard` puts it in
// PyTorch's guard registry in place of the Python one (the registry is non-owning: the guard is
// never freed, as PyTorch's own guards are not).
#pragma once

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {

struct KilnDeviceGuard final : public c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

  static c10::Device device() { return c10::Device(kType, 0); }
  static c10::Stream default_stream() { return c10::Stream(c10::Stream::DEFAULT, device()); }

  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device) const override { return device(); }
  c10::Device getDevice() const override { return device(); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override { return default_stream(); }
  c10::Stream getNewStream(c10::Device, int) const override { return default_stream(); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override { return default_stream(); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
};

// Makes KilnDeviceGuard the kiln device's guard (idempotent).  Returns whether the guard it
// replaced was another one (the Python guard lazy/device.py registered, or none).
bool install_device_guard() {
  static const KilnDeviceGuard* guard = new KilnDeviceGuard();
  const auto slot = static_cast<size_t>(c10::DeviceType::PrivateUse1);
  const c10::impl::DeviceGuardImplInterface* before =
      c10::impl::device_guard_impl_registry[slot].load();
  if (before == guard) return false;
  c10::impl::registerDeviceGuard(c10::DeviceType::PrivateUse1, guard);
  return true;
}

bool device_guard_installed() {
  const auto slot = static_cast<size_t>(c10::DeviceType::PrivateUse1);
  return dynamic_cast<const KilnDeviceGuard*>(
             c10::impl::device_guard_impl_registry[slot].load()) != nullptr;
}

}  // namespace
