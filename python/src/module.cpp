// strata._strata: the extension behind `import strata`. A thin binding of the C++ API the Python
// package needs (config loading, the Engine, communicators); python/strata/torch.py builds the
// torch optimizer on top of it. No torch header here: tensors cross as (address, element count)
// pairs that the Python side checks (contiguous, dtype, device) before passing them, and that the
// binding classifies where CUDA can tell (device memory is staged where host code reads it, or
// refused by name); parameters come back without a copy as DLPack capsules (host memory, or a
// CUDA engine's device memory: torch.utils.dlpack.from_dlpack; the buffer protocol and
// __cuda_array_interface__ too, for other consumers). CUDA streams cross as torch's integer
// handles (Stream.cuda_stream) for the engine's hand-offs.
//
// Lifetime: an Engine object owns its communicator and the strata::Engine; every ParamBuffer
// (and so every torch tensor aliasing the engine's parameters) keeps them alive.
// Threads: long calls (step, gradients, gathers, state, checkpoints) release the GIL; the engine
// itself is driven by one thread at a time (the training loop's), as in C++.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "c10d_communicator.hpp"
#include "dlpack.hpp"
#include "errors.hpp"
#include "strata/build_info.hpp"
#include "strata/cleanup.hpp"
#include "strata/communicator.hpp"
#include "strata/config.hpp"
#include "strata/device.hpp"
#include "strata/device_query.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#include "strata/profile.hpp"

namespace py = pybind11;

namespace strata::python {
namespace {

using Address = std::uintptr_t;

// The communicator and the engine, destroyed engine first.
struct EngineBox {
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Engine> engine;
  ~EngineBox() {
    engine.reset();
    comm.reset();
  }
};

// A writable byte buffer over one tensor's parameters inside the engine (stages 0-2: stable for
// the engine's lifetime), keeping the engine alive; both export DLPack (dlpack.hpp: what
// strata.torch uses, no numpy needed). ParamBuffer (host memory) also has the buffer protocol;
// DeviceParamBuffer (a CUDA engine's device memory, which host code cannot read) instead
// __cuda_array_interface__.
struct ParamBuffer {
  std::shared_ptr<EngineBox> box;
  void* data = nullptr;
  std::size_t bytes = 0;
  int ordinal = -1;  // the GPU of a DeviceParamBuffer
};
struct DeviceParamBuffer : ParamBuffer {};

// A caller's stream as the binding receives it: torch.cuda.Stream.cuda_stream (an int; 0 is the
// legacy default stream), or None (no stream: host code ordered by the call itself).
StreamHandle stream_handle(const py::object& s) {
  return s.is_none() ? nullptr : reinterpret_cast<StreamHandle>(s.cast<std::uintptr_t>());
}

StateKind state_kind(const std::string& s) {
  if (s == "master") return StateKind::kMaster;
  if (s == "exp_avg") return StateKind::kExpAvg;
  if (s == "exp_avg_sq") return StateKind::kExpAvgSq;
  fail(ErrorCode::kInvalidArgument,
       strcat("unknown state '", s, "' (master | exp_avg | exp_avg_sq)"));
}

// One MPI communicator held from the first MPI engine until interpreter exit: strata finalizes MPI
// when its last MPI communicator goes, and MPI cannot be initialized twice in a process, so a
// script that builds a second optimizer after dropping the first needs MPI to stay up.
std::unique_ptr<Communicator>& mpi_keeper() {
  static std::unique_ptr<Communicator> keeper;
  return keeper;
}

// A new MPI_COMM_WORLD communicator, MPI kept up by the keeper until interpreter exit.
std::unique_ptr<Communicator> mpi_communicator(double timeout) {
  if (!mpi_keeper()) {
    {
      py::gil_scoped_release nogil;
      mpi_keeper() = make_mpi_communicator(timeout);
    }
    py::module_::import("atexit").attr("register")(py::cpp_function([] { mpi_keeper().reset(); }));
  }
  py::gil_scoped_release nogil;
  return make_mpi_communicator(timeout);
}

class PyEngine {
 public:
  // comm: "single" (one rank, in-process), "mpi" (MPI_COMM_WORLD), "c10d" (process_group), "nccl"
  // (strata's NCCL on GPU `device`; make_nccl).
  PyEngine(const Config& config, const std::string& comm, py::handle process_group, int device) {
    box_ = std::make_shared<EngineBox>();
    cuda_ = config.runtime.device != DeviceKind::kHost;
    accum_ = config.precision.accum_dtype();
    const double timeout = config.runtime.collective_timeout_s;
    if (comm == "single") {
      box_->comm = std::move(make_inprocess_communicators(1, timeout)[0]);
    } else if (comm == "mpi") {
      box_->comm = mpi_communicator(timeout);
    } else if (comm == "c10d") {
      box_->comm = make_c10d_communicator(process_group, timeout);
    } else if (comm == "nccl") {
      box_->comm = make_nccl(config, process_group, device);
    } else {
      fail(ErrorCode::kInvalidArgument,
           strcat("unknown communicator '", comm, "' (single | mpi | c10d | nccl)"));
    }
    box_->engine = std::make_unique<Engine>(config, *box_->comm);
  }

  // strata's NCCL communicator on GPU `device` (the model's), its id exchanged over the host
  // communicator: `process_group` (c10d), else MPI under mpirun, else a one-rank world. The
  // engine puts its state on the rank's local GPU (LOCAL_RANK, ...; device.hpp): the model must
  // be there too.
  static std::unique_ptr<Communicator> make_nccl(const Config& config, py::handle process_group,
                                                 int device) {
    const double timeout = config.runtime.collective_timeout_s;
    std::unique_ptr<Communicator> host;
    if (!process_group.is_none()) {
      host = make_c10d_communicator(process_group, timeout);
    } else if (launched_by_mpi()) {
      host = mpi_communicator(timeout);
    } else {
      host = std::move(make_inprocess_communicators(1, timeout)[0]);
    }
    const int gpus = static_cast<int>(query_cuda_devices().devices.size());
    const int local =
        local_device_ordinal(host->rank(), static_cast<int>(config.ranks_per_node()), gpus);
    if (device != local)
      fail(ErrorCode::kInvalidArgument, strcat("the model is on cuda:", device, " but rank ",
                                               host->rank(), "'s GPU is cuda:", local,
                                               " (LOCAL_RANK, else the rank modulo "
                                               "world.ranks_per_node, of ",
                                               gpus, " visible): move the model to cuda:", local));
    NcclBootstrap boot;
    boot.host = host.get();
    py::gil_scoped_release nogil;
    return make_nccl_communicator(boot, device, timeout);
  }

  Engine& e() { return *box_->engine; }
  const Engine& e() const { return *box_->engine; }
  Communicator& comm() { return *box_->comm; }

  // Initial values in host memory, or in device memory (a CUDA model's tensor: copied to the host
  // first through the CUDA runtime, after the work queued on the legacy default stream; torch.py
  // synchronizes its current stream before).
  // borrow: host memory the caller keeps valid and unchanged until finalize() (no copy).
  TensorId add_parameter(const std::string& name, Address values, std::size_t numel, GroupId group,
                         bool borrow) {
    std::vector<float> staged;  // device memory: copied now, never borrowed
    const float* p = host_floats(values, numel, staged);
    return borrow && staged.empty() ? e().add_parameter_borrowed(name, {p, numel}, group)
                                    : e().add_parameter(name, {p, numel}, group);
  }

  bool on_device() { return e().device().kind() == DeviceKind::kCuda; }

  // Host code reads it: device memory is an error naming `what`, not a SIGSEGV.
  void require_host(Address a, const std::string& what) const {
    if (!cuda_) return;
    const PointerInfo info = query_pointer(reinterpret_cast<const void*>(a));
    if (info.kind == MemoryKind::kDevice)
      fail(ErrorCode::kInvalidArgument, strcat(what, ": the buffer is ", describe_memory(info),
                                               "; pass host memory (a CPU tensor)"));
  }

  py::object param_buffer(TensorId id) {
    if (e().stage() == 3)
      fail(ErrorCode::kInvalidArgument,
           "param_buffer: stage 3 parameters move; use gather + copy_param");
    return engine_memory(const_cast<void*>(e().param(id)), e().param_dtype(), id);
  }

  // Stages 0-1: the tensor's held gradient (Engine::gradient; precision.grad_accum).
  py::object grad_buffer(TensorId id) {
    if (e().stage() >= 2)
      fail(ErrorCode::kInvalidArgument,
           "grad_buffer: stages 2-3 keep no per-tensor gradient (bucketed, reduce-scattered)");
    return engine_memory(const_cast<void*>(e().gradient(id)), accum_, id);
  }

  // Engine memory of tensor `id` (numel elements of `dtype`), kept alive by the engine's box.
  py::object engine_memory(void* data, DType dtype, TensorId id) {
    ParamBuffer b;
    b.box = box_;
    b.data = data;
    b.bytes = e().numel(id) * dtype_size(dtype);
    b.ordinal = e().device().ordinal();
    if (on_device()) return py::cast(DeviceParamBuffer{std::move(b)});
    return py::cast(std::move(b));
  }

  // The gathered parameters of `id` into `dst` (host memory, or device memory of the engine's GPU,
  // after the work queued on `stream` so far: torch's allocator may hand out memory its stream
  // still uses).
  void copy_param(TensorId id, Address dst, py::object stream) {
    copy_params({id}, {dst}, std::move(stream));
  }

  // The stage-3 gathers' copies, batched: every tensor of `ids` into its `dsts` entry, the copies
  // queued after `stream`'s work and waited for once (one host wait per module, not per tensor).
  void copy_params(const std::vector<TensorId>& ids, const std::vector<Address>& dsts,
                   py::object stream) {
    if (ids.size() != dsts.size())
      fail(ErrorCode::kInvalidArgument,
           strcat("copy_params: ", ids.size(), " ids and ", dsts.size(), " destinations"));
    auto bytes = [&](std::size_t i) { return e().numel(ids[i]) * dtype_size(e().param_dtype()); };
    if (!on_device()) {
      for (std::size_t i = 0; i < ids.size(); ++i)
        std::memcpy(reinterpret_cast<void*>(dsts[i]), e().param(ids[i]), bytes(i));
      return;
    }
    const StreamHandle caller = stream_handle(stream);
    py::gil_scoped_release nogil;
    if (!copy_stream_) copy_stream_ = e().device().create_stream();
    copy_stream_->wait_external(caller);
    for (std::size_t i = 0; i < ids.size(); ++i)
      copy_stream_->memcpy_async(reinterpret_cast<void*>(dsts[i]), e().param(ids[i]), bytes(i));
    copy_stream_->synchronize(timeout());
  }

  // State reads and writes take host memory or device memory (a CUDA tensor: staged through host
  // memory with a copy through the CUDA runtime).
  void read_state(TensorId id, const std::string& kind, Address out) {
    const std::size_t n = e().numel(id);
    auto* p = reinterpret_cast<float*>(out);
    if (n == 0 || !is_device_memory(p)) return e().read_state(id, state_kind(kind), {p, n});
    std::vector<float> host(n);
    e().read_state(id, state_kind(kind), host);
    copy_any_memory(p, host.data(), n * sizeof(float));
  }
  void write_state(TensorId id, const std::string& kind, Address in) {
    const std::size_t n = e().numel(id);
    std::vector<float> staged;
    e().write_state(id, state_kind(kind), {host_floats(in, n, staged), n});
  }
  // (id, kind, address) each: one Engine::write_states (each NVMe chunk read and written once).
  void write_states(const std::vector<std::tuple<TensorId, std::string, Address>>& writes) {
    std::vector<StateWrite> w;
    std::vector<std::vector<float>> staged;  // (a vector's buffer stays put when `staged` grows)
    for (const auto& [id, kind, in] : writes) {
      const std::size_t n = e().numel(id);
      w.push_back({id, state_kind(kind), {host_floats(in, n, staged.emplace_back()), n}});
    }
    e().write_states(w);
  }

 private:
  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(static_cast<std::int64_t>(box_->comm->timeout_s() * 1000.0) +
                                     1);
  }

  // Device memory: only where a GPU may be the engine's (the query needs the CUDA runtime).
  bool is_device_memory(const void* p) const {
    return cuda_ && query_pointer(p).kind == MemoryKind::kDevice;
  }
  // `n` floats at `in` as host memory: device memory copied into `staged` (the caller keeps it
  // while the engine reads), host memory as it is.
  const float* host_floats(Address in, std::size_t n, std::vector<float>& staged) const {
    const auto* p = reinterpret_cast<const float*>(in);
    if (n == 0 || !is_device_memory(p)) return p;
    staged.resize(n);
    copy_any_memory(staged.data(), p, n * sizeof(float));
    return staged.data();
  }

  std::shared_ptr<EngineBox> box_;
  bool cuda_ = false;                    // runtime.device is not host: a GPU may be the engine's
  DType accum_ = DType::kFp32;           // precision.grad_accum: the held gradients' dtype
  std::unique_ptr<Stream> copy_stream_;  // copy_param on a GPU (destroyed before the engine)
};

DType dtype_of(const std::string& s) {
  if (s == "fp32") return DType::kFp32;
  if (s == "bf16") return DType::kBf16;
  if (s == "fp16") return DType::kFp16;
  fail(ErrorCode::kInvalidArgument, strcat("unknown dtype '", s, "' (fp32 | bf16 | fp16)"));
}

// A bare c10d communicator (tests of that backend): collectives over (address, count) buffers.
struct PyComm {
  std::unique_ptr<Communicator> c;
};
struct PyHandle {
  std::unique_ptr<CommHandle> h;
};

// A collective over per-rank shares (Communicator::reduce_scatter_async or all_gather_async) with
// Python's arguments: buffer addresses, the per-rank counts, the dtype's name.
template <auto Collective>
PyHandle shares_async(PyComm& c, Address send, Address recv, std::vector<std::size_t> counts,
                      const std::string& dt) {
  return PyHandle{((*c.c).*Collective)(reinterpret_cast<const void*>(send),
                                       reinterpret_cast<void*>(recv), counts, dtype_of(dt))};
}

py::dict step_result(const StepResult& r) {
  py::dict d;
  d["applied"] = r.applied;
  d["overflow"] = r.overflow;
  d["grad_norm"] = r.grad_norm;
  d["clip_coef"] = r.clip_coef;
  d["loss_scale"] = r.loss_scale;
  d["speculated_chunks"] = r.speculated_chunks;
  d["committed_chunks"] = r.committed_chunks;
  d["rolled_back_chunks"] = r.rolled_back_chunks;
  d["exposed_s"] = r.exposed_s;
  return d;
}

py::dict stats_dict(const EngineStats& s) {
  py::dict d;
  d["loss_scale"] = s.loss_scale;
  d["steps"] = s.steps;
  d["applied_steps"] = s.applied_steps;
  d["skipped_steps"] = s.skipped_steps;
  d["last_grad_norm"] = s.last_grad_norm;
  d["reduce_s"] = s.reduce_s;
  d["grad_spill_s"] = s.grad_spill_s;
  d["buckets_reduced"] = s.buckets_reduced;
  d["norm_s"] = s.norm_s;
  d["optimizer_s"] = s.optimizer_s;
  d["gather_s"] = s.gather_s;
  d["step_s"] = s.step_s;
  d["checkpoint_blocked_s"] = s.checkpoint_blocked_s;
  d["speculated_chunks"] = s.speculated_chunks;
  d["committed_chunks"] = s.committed_chunks;
  d["rolled_back_chunks"] = s.rolled_back_chunks;
  d["exposed_s"] = s.exposed_s;
  py::dict bytes, calls;
  for (std::size_t k = 0; k < kCollectiveKinds; ++k) {
    const char* name = collective_name(static_cast<CollectiveKind>(k));
    bytes[name] = s.comm.bytes_sent[k];
    calls[name] = s.comm.calls[k];
  }
  d["comm_bytes_sent"] = bytes;
  d["comm_calls"] = calls;
  return d;
}

py::dict config_dict(const Config& c) {
  py::dict d;
  d["source"] = c.source;
  d["stage"] = c.zero.stage;
  d["params_dtype"] = dtype_name(c.precision.params);
  d["grads_dtype"] = dtype_name(c.precision.grads);
  d["grad_accum_dtype"] = dtype_name(c.precision.accum_dtype());
  d["optimizer"] = optimizer_name(c.optimizer.type);
  d["lr"] = c.optimizer.lr;
  d["betas"] = py::make_tuple(c.optimizer.beta1, c.optimizer.beta2);
  d["eps"] = c.optimizer.eps;
  d["weight_decay"] = c.optimizer.weight_decay;
  d["grad_clip"] = c.optimizer.grad_clip;
  d["optimizer_tier"] = tier_name(c.offload.optimizer.tier);
  d["gradients_tier"] = tier_name(c.offload.gradients.tier);
  d["params_tier"] = tier_name(c.offload.params.tier);
  d["nvme_paths"] = c.tiers.nvme.paths;
  d["communicator"] = comm_backend_name(c.runtime.communicator);
  d["collective_timeout_s"] = c.runtime.collective_timeout_s;
  d["cpu_threads"] = c.runtime.cpu_threads;
  d["loss_scale_initial"] = c.precision.loss_scale.initial;
  d["loss_scale_dynamic"] = c.precision.loss_scale.dynamic;
  d["accumulate"] = c.train.accumulate;  // train.accumulate: for the loop to read (it decides)
  return d;
}

}  // namespace
}  // namespace strata::python

PYBIND11_MODULE(_strata, m) {
  using namespace strata;
  using namespace strata::python;
  m.doc() = "strata's C++ engine (private: use strata.torch.ZeroOptimizer)";
  register_error_translator();
  m.attr("__version__") = build::kVersion;
  m.attr("with_mpi") = build::kWithMpi;
  m.attr("with_cuda") = build::kWithCuda;

  m.def(
      "set_log_level", [](const std::string& level) { set_log_level(parse_log_level(level)); },
      "Sets strata's log level: debug | info | warn | error | off (messages go to stderr).");
  m.def("log_level", [] { return std::string(log_level_name(log_level())); });
  m.def("launched_by_mpi", &launched_by_mpi);
  m.def("mpi_available", &mpi_available);
  // strata/_cleanup.py: the swap removal of its chained SIGTERM/SIGINT/SIGHUP handlers.
  m.def("_run_signal_cleanup", [] { return run_signal_cleanup(); });

  py::class_<Config>(m, "Config")
      .def("to_yaml", [](const Config& c) { return to_yaml(c); })
      .def("summary", &config_dict, "The fields the Python side reads, as a dict.")
      .def_property_readonly("source", [](const Config& c) { return c.source; });
  m.def("load_config", &load_config, py::arg("path"),
        py::arg("overrides") = std::vector<std::string>{});
  m.def(
      "parse_config",
      [](const std::string& yaml, const std::string& source,
         const std::vector<std::string>& overrides) {
        return parse_config(yaml, source, overrides);
      },
      py::arg("yaml"), py::arg("source") = "<string>",
      py::arg("overrides") = std::vector<std::string>{});

  py::class_<ParamBuffer>(m, "ParamBuffer", py::buffer_protocol())
      .def_buffer([](ParamBuffer& b) {
        return py::buffer_info(b.data, 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.bytes)}, {1}, /*readonly=*/false);
      })
      .def_property_readonly("address",
                             [](const ParamBuffer& b) { return reinterpret_cast<Address>(b.data); })
      .def_property_readonly("nbytes", [](const ParamBuffer& b) { return b.bytes; })
      .def("__dlpack_device__",
           [](const ParamBuffer&) { return py::make_tuple(static_cast<int>(DlDevice::kCpu), 0); })
      .def(
          "__dlpack__",
          [](const ParamBuffer& b, const py::object&) {
            return dlpack_capsule(b.box, b.data, b.bytes, DlDevice::kCpu, 0);
          },
          py::arg("stream") = py::none());
  // torch.from_dlpack: the engine wrote the parameters on its own streams and synchronized them
  // before returning (step, load, write_state), so a consumer's stream has nothing to wait for.
  py::class_<DeviceParamBuffer>(m, "DeviceParamBuffer")
      .def("__dlpack_device__",
           [](const DeviceParamBuffer& b) {
             return py::make_tuple(static_cast<int>(DlDevice::kCuda), b.ordinal);
           })
      .def(
          "__dlpack__",
          [](const DeviceParamBuffer& b, const py::object&) {
            return dlpack_capsule(b.box, b.data, b.bytes, DlDevice::kCuda, b.ordinal);
          },
          py::arg("stream") = py::none())
      .def_property_readonly(
          "address", [](const DeviceParamBuffer& b) { return reinterpret_cast<Address>(b.data); })
      .def_property_readonly("nbytes", [](const DeviceParamBuffer& b) { return b.bytes; })
      .def_property_readonly("__cuda_array_interface__", [](const DeviceParamBuffer& b) {
        py::dict d;
        d["shape"] = py::make_tuple(b.bytes);
        d["typestr"] = "|u1";
        d["data"] = py::make_tuple(reinterpret_cast<Address>(b.data), false);
        d["version"] = 2;
        return d;
      });

  using G = py::call_guard<py::gil_scoped_release>;
  py::class_<PyHandle>(m, "CommHandle")
      .def(
          "wait", [](PyHandle& h) { h.h->wait(); }, G())
      .def(
          "done", [](PyHandle& h) { return h.h->done(); }, G());
  py::class_<PyComm>(m, "Comm")
      .def(py::init([](py::handle pg, double timeout) {
             auto c = std::make_unique<PyComm>();
             c->c = make_c10d_communicator(pg, timeout);
             return c;
           }),
           py::arg("process_group"), py::arg("timeout_s") = 60.0)
      .def_property_readonly("rank", [](PyComm& c) { return c.c->rank(); })
      .def_property_readonly("size", [](PyComm& c) { return c.c->size(); })
      .def_property_readonly("backend", [](PyComm& c) { return std::string(c.c->backend_name()); })
      .def(
          "all_reduce_async",
          [](PyComm& c, Address send, Address recv, std::size_t count, const std::string& dt) {
            return PyHandle{c.c->all_reduce_async(reinterpret_cast<const void*>(send),
                                                  reinterpret_cast<void*>(recv), count,
                                                  dtype_of(dt))};
          },
          G())
      .def("reduce_scatter_async", &shares_async<&Communicator::reduce_scatter_async>, G())
      .def("all_gather_async", &shares_async<&Communicator::all_gather_async>, G())
      .def(
          "broadcast_async",
          [](PyComm& c, Address buf, std::size_t count, const std::string& dt, int root) {
            return PyHandle{
                c.c->broadcast_async(reinterpret_cast<void*>(buf), count, dtype_of(dt), root)};
          },
          G())
      .def(
          "barrier_async", [](PyComm& c) { return PyHandle{c.c->barrier_async()}; }, G())
      .def("stats", [](PyComm& c) {
        CommStats s = c.c->stats();
        py::dict bytes, calls;
        for (std::size_t k = 0; k < kCollectiveKinds; ++k) {
          bytes[collective_name(static_cast<CollectiveKind>(k))] = s.bytes_sent[k];
          calls[collective_name(static_cast<CollectiveKind>(k))] = s.calls[k];
        }
        py::dict d;
        d["bytes_sent"] = bytes;
        d["calls"] = calls;
        return d;
      });
  py::class_<PyEngine>(m, "Engine")
      .def(py::init<const Config&, const std::string&, py::handle, int>(), py::arg("config"),
           py::arg("comm"), py::arg("process_group") = py::none(), py::arg("device") = -1)
      .def_property_readonly("device", [](PyEngine& s) { return s.on_device() ? "cuda" : "host"; })
      .def_property_readonly("rank", [](PyEngine& s) { return s.comm().rank(); })
      .def_property_readonly("world", [](PyEngine& s) { return s.comm().size(); })
      .def_property_readonly("backend",
                             [](PyEngine& s) { return std::string(s.comm().backend_name()); })
      .def_property_readonly("stage", [](const PyEngine& s) { return s.e().stage(); })
      .def_property_readonly(
          "param_dtype",
          [](const PyEngine& s) { return std::string(dtype_name(s.e().param_dtype())); })
      .def_property_readonly(
          "grad_dtype",
          [](const PyEngine& s) { return std::string(dtype_name(s.e().grad_dtype())); })
      .def("add_param_group",
           [](PyEngine& s, double lr, double wd) {
             return s.e().add_param_group({lr, wd});
           })
      .def("add_parameter", &PyEngine::add_parameter, G(), py::arg("name"), py::arg("values"),
           py::arg("numel"), py::arg("group") = 0, py::arg("borrow") = false)
      .def("num_groups", [](const PyEngine& s) { return s.e().num_groups(); })
      .def("set_lr", [](PyEngine& s, double lr, GroupId g) { s.e().set_lr(lr, g); })
      .def("lr", [](const PyEngine& s, GroupId g) { return s.e().lr(g); })
      .def("set_weight_decay",
           [](PyEngine& s, double wd, GroupId g) { s.e().set_weight_decay(wd, g); })
      .def("weight_decay", [](const PyEngine& s, GroupId g) { return s.e().weight_decay(g); })
      .def("set_betas",
           [](PyEngine& s, double b1, double b2, GroupId g) { s.e().set_betas(b1, b2, g); })
      .def("betas", [](const PyEngine& s, GroupId g) { return s.e().betas(g); })
      .def("set_eps", [](PyEngine& s, double eps, GroupId g) { s.e().set_eps(eps, g); })
      .def("eps", [](const PyEngine& s, GroupId g) { return s.e().eps(g); })
      .def(
          "clip_grad_norm",
          [](PyEngine& s, double max_norm) {
            py::gil_scoped_release nogil;
            return s.e().clip_grad_norm(max_norm);
          },
          py::arg("max_norm"))
      .def(
          "finalize", [](PyEngine& s) { s.e().finalize(); }, G())
      .def("numel", [](const PyEngine& s, TensorId id) { return s.e().numel(id); })
      .def("param_buffer", &PyEngine::param_buffer)
      .def("grad_buffer", &PyEngine::grad_buffer)
      .def("params_are_master", [](const PyEngine& s) { return s.e().params_are_master(); })
      .def("copy_param", &PyEngine::copy_param, py::arg("id"), py::arg("dst"),
           py::arg("stream") = py::none())
      .def("copy_params", &PyEngine::copy_params, py::arg("ids"), py::arg("dsts"),
           py::arg("stream") = py::none())
      .def(
          "gather", [](PyEngine& s, std::vector<TensorId> ids) { s.e().gather(ids); }, G())
      .def(
          "prefetch", [](PyEngine& s, std::vector<TensorId> ids) { s.e().prefetch(ids); }, G())
      .def(
          "release", [](PyEngine& s, std::vector<TensorId> ids) { s.e().release(ids); }, G())
      .def("loss_scale", [](const PyEngine& s) { return s.e().loss_scale(); })
      .def(
          "set_gradient",
          [](PyEngine& s, TensorId id, Address grad) {
            s.e().set_gradient_host(id, reinterpret_cast<const void*>(grad));
          },
          G())
      // No gradient on this rank (the loss did not use the parameter): zeros, and the update
      // skips the tensor when no rank used it.
      .def(
          "skip_gradient", [](PyEngine& s, TensorId id) { s.e().skip_gradient(id); }, G())
      // A gradient in device memory of the engine's GPU, written by work queued on `stream`
      // (torch.cuda.current_stream().cuda_stream): the engine's copy waits for it on the GPU and
      // the call returns without waiting (Engine::set_gradient_async): the caller keeps `grad`
      // until the work queued on gradient_stream completes (g.record_stream).
      .def("set_gradient_device",
           [](PyEngine& s, TensorId id, Address grad, py::object stream) {
             const StreamHandle producer = stream_handle(stream);
             py::gil_scoped_release nogil;
             s.e().set_gradient_async(id, reinterpret_cast<const void*>(grad), producer);
           })
      // The stream set_gradient_device's copies run on (an int cudaStream_t; 0 on the host).
      .def_property_readonly(
          "gradient_stream",
          [](PyEngine& s) { return reinterpret_cast<Address>(s.e().gradient_stream()); })
      // stream: the caller's (None: no hand-off), waited for before the parameters change.
      .def(
          "step",
          [](PyEngine& s, py::object stream) {
            const StreamHandle consumer = stream_handle(stream);
            const bool handoff = !stream.is_none();
            StepResult r;
            {
              py::gil_scoped_release nogil;
              r = handoff ? s.e().step(consumer) : s.e().step();
            }
            return step_result(r);
          },
          py::arg("stream") = py::none())
      .def("stats", [](const PyEngine& s) { return stats_dict(s.e().stats()); })
      // Benchmarks only (bench/python/bench_optimizer_step.py): the device bound of this engine's
      // update as `strata bench step` measures it (zero::EngineAccess::measure) — read || write
      // back every host-computed chunk unchanged (t_io_s), and Adam alone on chunks held in
      // memory (t_update_s). The state is not changed. Also the last step's update loop: its
      // time, its computes, its waits for reads and writes, its gate (last_loop_*).
      // Benchmarks only (bench/python/bench_optimizer_step.py): measure_engine_bound
      // (strata/profile.hpp), as `strata bench step` measures the update's device bound.
      .def("_measure_bound",
           [](PyEngine& s) {
             EngineBound b;
             {
               py::gil_scoped_release nogil;
               b = measure_engine_bound(s.e());
             }
             py::dict d;
             d["t_io_s"] = b.t_io_s;
             d["t_update_s"] = b.t_update_s;
             d["last_loop_s"] = b.last_loop_s;
             d["last_loop_compute_s"] = b.last_loop_compute_s;
             d["last_loop_wait_read_s"] = b.last_loop_wait_read_s;
             d["last_loop_wait_write_s"] = b.last_loop_wait_write_s;
             d["last_loop_gate_s"] = b.last_loop_gate_s;
             return d;
           })
      .def("read_state", &PyEngine::read_state, G())
      .def("write_state", &PyEngine::write_state, G())
      .def("write_states", &PyEngine::write_states, G())
      .def("optimizer_step", [](const PyEngine& s) { return s.e().optimizer_step(); })
      .def("set_optimizer_step", [](PyEngine& s, std::int64_t v) { s.e().set_optimizer_step(v); })
      // One parameter's own step count (torch's per-parameter state["step"]).
      .def("tensor_step", [](const PyEngine& s, TensorId id) { return s.e().optimizer_step(id); })
      .def("set_tensor_step",
           [](PyEngine& s, TensorId id, std::int64_t v) { s.e().set_optimizer_step(id, v); })
      .def(
          "save_checkpoint",
          [](PyEngine& s, const std::string& d, const std::string& client_state,
             std::vector<std::vector<std::uint64_t>> shapes,
             std::vector<std::vector<std::string>> aliases,
             const std::vector<std::tuple<std::string, std::string, std::vector<std::uint64_t>,
                                          Address, std::size_t>>& extra,
             bool blocking) {
            // extra: (name, safetensors dtype, shape, address, bytes) of host tensors the caller
            // keeps alive for the call (written during it, also by an asynchronous save).
            CheckpointModel model{std::move(shapes), std::move(aliases), {}};
            for (const auto& [name, dtype, shape, address, bytes] : extra) {
              s.require_host(address, strcat("save_checkpoint: extra tensor '", name, "'"));
              model.extra.push_back(
                  {name, dtype, shape, {reinterpret_cast<const unsigned char*>(address), bytes}});
            }
            s.e().save_checkpoint(d, blocking ? SaveMode::kBlocking : SaveMode::kAsync,
                                  client_state, model);
          },
          G(), py::arg("dir"), py::arg("client_state") = std::string(),
          py::arg("shapes") = std::vector<std::vector<std::uint64_t>>(),
          py::arg("aliases") = std::vector<std::vector<std::string>>(),
          py::arg("extra") =
              std::vector<std::tuple<std::string, std::string, std::vector<std::uint64_t>, Address,
                                     std::size_t>>(),
          py::arg("blocking") = true)
      .def(
          "wait_checkpoint", [](PyEngine& s) { s.e().wait_checkpoint(); }, G())
      .def("checkpoint_pending", [](const PyEngine& s) { return s.e().checkpoint_pending(); })
      .def(
          "load_checkpoint", [](PyEngine& s, const std::string& d) { s.e().load_checkpoint(d); },
          G())
      .def(
          "discard_gradients", [](PyEngine& s) { s.e().discard_gradients(); }, G())
      .def("checkpoint_client_state",
           [](const PyEngine& s) { return s.e().checkpoint_client_state(); })
      .def(
          "barrier", [](PyEngine& s) { s.comm().barrier(); }, G());
}
