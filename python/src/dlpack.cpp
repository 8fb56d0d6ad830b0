// DLPack export (dlpack.hpp).
#include "dlpack.hpp"

#include <cstdint>
#include <cstring>

namespace py = pybind11;

namespace strata::python {
namespace {

// DLPack 0.x ABI (dlpack/dlpack.h), as torch.utils.dlpack consumes it.
struct DLDeviceDesc {
  std::int32_t device_type;
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;  // kDLUInt = 1
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDeviceDesc device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // null: compact row-major
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

struct Managed {
  DLManagedTensor t{};
  std::int64_t shape[1] = {0};
  std::shared_ptr<void> owner;
};

// Called by the consumer when its tensor is freed: on any thread, with or without the GIL. The
// owner may hold the last reference to the engine, whose communicator may hold Python objects.
void release(DLManagedTensor* self) {
  auto* m = static_cast<Managed*>(self->manager_ctx);
  if (Py_IsInitialized() == 0) {  // the interpreter is gone: the engine is left to the exit
    (void)new std::shared_ptr<void>(std::move(m->owner));  // (its comm may hold Python objects)
    delete m;
    return;
  }
  py::gil_scoped_acquire gil;
  delete m;
}

constexpr const char* kName = "dltensor";           // a capsule not consumed yet
constexpr const char* kUsedName = "used_dltensor";  // renamed by the consumer, which owns it now

void drop_unconsumed(PyObject* capsule) {
  if (std::strcmp(PyCapsule_GetName(capsule), kName) != 0) return;
  auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kName));
  if (t != nullptr) t->deleter(t);
}

}  // namespace

py::capsule dlpack_capsule(std::shared_ptr<void> owner, void* data, std::size_t bytes,
                           DlDevice device, int ordinal) {
  auto* m = new Managed;
  m->owner = std::move(owner);
  m->shape[0] = static_cast<std::int64_t>(bytes);
  m->t.dl_tensor.data = data;
  m->t.dl_tensor.device = {static_cast<std::int32_t>(device),
                           device == DlDevice::kCpu ? 0 : ordinal};
  m->t.dl_tensor.ndim = 1;
  m->t.dl_tensor.dtype = {1, 8, 1};
  m->t.dl_tensor.shape = m->shape;
  m->t.dl_tensor.strides = nullptr;
  m->t.dl_tensor.byte_offset = 0;
  m->t.manager_ctx = m;
  m->t.deleter = &release;
  PyObject* c = PyCapsule_New(&m->t, kName, &drop_unconsumed);
  if (c == nullptr) {
    delete m;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(c);
}

}  // namespace strata::python
