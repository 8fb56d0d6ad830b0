// Fake NCCL on the fake CUDA runtime, for ranks that are threads of one process.
//
// - ncclGetUniqueId makes an id this process knows; ncclCommInitRank(Config) with an id nobody
//   made here (a stale bootstrap file) never completes, like a real init whose root is gone.
// - Non-blocking init (config.blocking = 0): returns ncclInProgress; ncclCommGetAsyncError says
//   ncclInProgress until every rank has joined. A device used by two ranks of one communicator
//   fails the init with ncclInvalidUsage ("Duplicate GPU detected"), as NCCL does.
// - Collectives run on the given stream (which must belong to the communicator's device) and block
//   that stream until every rank's stream has reached the same collective; buffers must be device
//   memory of that device (ncclInvalidArgument otherwise). Receive buffers are poisoned when
//   queued. Sums are taken in rank order in float.
// - ncclCommAbort releases this rank's blocked collectives (their output is not written) and
//   frees the communicator; later use of the handle is the caller's bug.
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>

#include "fakecuda/fake_internal.hpp"

using namespace fakecuda;

namespace {

struct Op {
  const char* src = nullptr;  // shadow
  char* dst = nullptr;        // shadow
};

struct Group {
  int nranks = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, int> devices;                          // rank -> device
  std::map<std::uint64_t, std::map<int, Op>> arrived;  // collective seq -> rank -> buffers
  std::map<std::uint64_t, int> released;               // seq -> ranks that left
  std::map<std::uint64_t, bool> done;
  bool failed = false;
};

struct CommState {
  std::shared_ptr<Group> group;
  int rank = 0, device = 0;
  ncclResult_t state = ncclInProgress;
  bool aborted = false;
  std::uint64_t seq = 0;  // next collective
};

struct NcclRegistry {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<Group>> groups;  // by id bytes
};

NcclRegistry& nccl_registry() {
  static NcclRegistry* r = new NcclRegistry();
  return *r;
}

std::string key(const ncclUniqueId& id) { return std::string(id.internal, 32); }

std::size_t elem_size(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32: return 4;
    case ncclFloat16: return 2;
    case ncclBfloat16: return 2;
    default: return 0;
  }
}

float load(ncclDataType_t t, const char* p, std::size_t i) {
  if (t == ncclFloat32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  if (t == ncclBfloat16) {
    const std::uint32_t bits = std::uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  // fp16 -> float
  const std::uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -24);
    if (sign) f = -f;
    return f;
  }
  const std::uint32_t bits =
      exp == 0x1f ? sign | 0x7f800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
  std::memcpy(&f, &bits, 4);
  return f;
}

void store(ncclDataType_t t, char* p, std::size_t i, float f) {
  if (t == ncclFloat32) {
    std::memcpy(p + 4 * i, &f, 4);
    return;
  }
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  std::uint16_t h;
  if (t == ncclBfloat16) {
    h = (x & 0x7fffffffu) > 0x7f800000u
            ? 0x7fff
            : static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
  } else {
    // float -> half, round to nearest even (normal and subnormal ranges).
    const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
    const std::uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) {
      h = 0x7fff;
    } else if (a >= 0x477ff000u) {
      h = sign | 0x7c00u;
    } else if (a < 0x38800000u) {
      const float scaled = std::ldexp(std::fabs(f), 24);  // exact: subnormal half units
      h = sign | static_cast<std::uint16_t>(std::nearbyint(scaled));
    } else {
      std::uint32_t v = a - (112u << 23);
      const std::uint32_t rem = v & 0x1fffu;
      v >>= 13;
      if (rem > 0x1000u || (rem == 0x1000u && (v & 1u))) ++v;
      h = sign | static_cast<std::uint16_t>(v);
    }
  }
  std::memcpy(p + 2 * i, &h, 2);
}

enum class Kind { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kReduce };

struct Collective {
  Kind kind;
  std::size_t count;  // per-rank count (reduce-scatter, all-gather) or total
  ncclDataType_t type;
  int root = 0;
};

// Computes every rank's output from every rank's input (inputs first: buffers may be in place).
void compute(const Collective& c, std::map<int, Op>& ops, int nranks) {
  const std::size_t es = elem_size(c.type);
  std::map<int, std::vector<char>> out;
  if (c.kind == Kind::kAllReduce || c.kind == Kind::kReduceScatter || c.kind == Kind::kReduce) {
    const std::size_t total = c.kind == Kind::kReduceScatter ? c.count * nranks : c.count;
    std::vector<char> sum(total * es);
    for (std::size_t i = 0; i < total; ++i) {
      float s = 0.0f;
      for (int r = 0; r < nranks; ++r)
        s = r == 0 ? load(c.type, ops[r].src, i) : s + load(c.type, ops[r].src, i);
      store(c.type, sum.data(), i, s);
    }
    for (int r = 0; r < nranks; ++r) {
      if (c.kind == Kind::kReduce && r != c.root) continue;
      if (c.kind == Kind::kReduceScatter)
        out[r].assign(sum.begin() + r * c.count * es, sum.begin() + (r + 1) * c.count * es);
      else
        out[r] = sum;
    }
  } else if (c.kind == Kind::kAllGather) {
    std::vector<char> all(c.count * nranks * es);
    for (int r = 0; r < nranks; ++r)
      std::memcpy(all.data() + r * c.count * es, ops[r].src, c.count * es);
    for (int r = 0; r < nranks; ++r) out[r] = all;
  } else {  // broadcast
    std::vector<char> b(ops[c.root].src, ops[c.root].src + c.count * es);
    for (int r = 0; r < nranks; ++r) out[r] = b;
  }
  for (auto& [r, bytes] : out) std::memcpy(ops[r].dst, bytes.data(), bytes.size());
}

struct Handle {
  std::shared_ptr<CommState> s;
};

CommState* state(ncclComm_t c) { return c ? reinterpret_cast<Handle*>(c)->s.get() : nullptr; }

// Queues a collective on `stream`: the task waits until every rank's task of the same sequence
// number has arrived, the last one computes, everyone leaves.
ncclResult_t issue(ncclComm_t comm, const Collective& c, const void* send, std::size_t send_bytes,
                   void* recv, std::size_t recv_bytes, cudaStream_t stream) {
  if (!comm) return ncclInvalidArgument;
  std::shared_ptr<CommState> cs = reinterpret_cast<Handle*>(comm)->s;
  if (cs->state != ncclSuccess) return ncclInvalidUsage;
  if (elem_size(c.type) == 0) return ncclInvalidArgument;
  Runtime& rt = Runtime::get();
  if (!rt.valid_stream(stream)) return ncclUnhandledCudaError;
  auto s = rt.stream(stream);
  if (s->device != cs->device) return ncclInvalidUsage;  // stream of another GPU
  int d1 = -1, d2 = -1;
  const char* src = send_bytes ? rt.shadow_of(send, send_bytes, &d1) : nullptr;
  char* dst = recv_bytes ? rt.shadow_of(recv, recv_bytes, &d2) : nullptr;
  if ((send_bytes && (!src || d1 != cs->device)) || (recv_bytes && (!dst || d2 != cs->device)))
    return ncclInvalidArgument;  // not device memory of this communicator's GPU
  if (dst && !(src && dst < src + send_bytes && src < dst + recv_bytes) &&
      !rt.range_busy(Range{reinterpret_cast<std::uintptr_t>(dst),
                           reinterpret_cast<std::uintptr_t>(dst) + recv_bytes},
                     cs->device))
    std::memset(dst, 0xFF, recv_bytes);  // poisoned until the collective runs
  const std::uint64_t seq = cs->seq++;
  rt.count("nccl_collective");
  Task t;
  t.what = "nccl collective";
  t.run = [cs, c, seq, src, dst] {
    Group& g = *cs->group;
    std::unique_lock<std::mutex> lock(g.mu);
    g.arrived[seq][cs->rank] = Op{src, dst};
    if (static_cast<int>(g.arrived[seq].size()) == g.nranks) {
      compute(c, g.arrived[seq], g.nranks);
      g.done[seq] = true;
      g.cv.notify_all();
    }
    g.cv.wait(lock, [&] { return g.done[seq] || cs->aborted; });
    if (++g.released[seq] == g.nranks) {
      g.arrived.erase(seq);
      g.released.erase(seq);
      g.done.erase(seq);
    }
  };
  Pending pend;
  pend.kernel_device = cs->device;
  rt.enqueue(s, std::move(t), std::move(pend));
  return ncclSuccess;
}

}  // namespace

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return ncclInvalidArgument;
  static std::mt19937_64 rng(std::random_device{}());
  std::lock_guard<std::mutex> lock(nccl_registry().mu);
  std::memset(id->internal, 0, sizeof id->internal);
  std::memcpy(id->internal, "FAKENCCL", 8);
  for (int i = 8; i < 32; i += 8) {
    const std::uint64_t x = rng();
    std::memcpy(id->internal + i, &x, 8);
  }
  auto g = std::make_shared<Group>();
  nccl_registry().groups[key(*id)] = g;
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  if (!comm || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return ncclUnhandledCudaError;
  auto cs = std::make_shared<CommState>();
  cs->rank = rank;
  cs->device = dev;
  {
    std::lock_guard<std::mutex> lock(nccl_registry().mu);
    auto it = nccl_registry().groups.find(key(id));
    // An id nobody made here: the root is gone; the init never completes (state stays
    // ncclInProgress; a blocking init would hang).
    cs->group = it != nccl_registry().groups.end() ? it->second : std::make_shared<Group>();
    if (it == nccl_registry().groups.end()) cs->group->nranks = -1;
  }
  Group& g = *cs->group;
  {
    std::lock_guard<std::mutex> lock(g.mu);
    if (g.nranks == 0) g.nranks = nranks;
    if (g.nranks > 0 && g.nranks != nranks) return ncclInvalidArgument;
    for (const auto& [r, d] : g.devices)
      if (d == dev) {
        g.failed = true;  // NCCL: "Duplicate GPU detected"
        g.cv.notify_all();
        return ncclInvalidUsage;
      }
    g.devices[rank] = dev;
    g.cv.notify_all();
  }
  *comm = reinterpret_cast<ncclComm_t>(new Handle{cs});
  const bool blocking = !config || config->blocking != 0;
  if (blocking) {
    std::unique_lock<std::mutex> lock(g.mu);
    g.cv.wait(lock, [&] { return g.failed || static_cast<int>(g.devices.size()) == g.nranks; });
    cs->state = g.failed ? ncclInvalidUsage : ncclSuccess;
    return cs->state;
  }
  return ncclInProgress;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async) {
  CommState* cs = state(comm);
  if (!cs || !async) return ncclInvalidArgument;
  if (cs->state == ncclInProgress) {
    Group& g = *cs->group;
    std::lock_guard<std::mutex> lock(g.mu);
    if (g.failed)
      cs->state = ncclInvalidUsage;
    else if (static_cast<int>(g.devices.size()) == g.nranks)
      cs->state = ncclSuccess;
  }
  *async = cs->state;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  auto* h = reinterpret_cast<Handle*>(comm);
  {
    Group& g = *h->s->group;
    std::lock_guard<std::mutex> lock(g.mu);
    h->s->aborted = true;
    g.cv.notify_all();
  }
  delete h;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  delete reinterpret_cast<Handle*>(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  CommState* cs = state(comm);
  if (!cs || !count) return ncclInvalidArgument;
  *count = cs->group->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  CommState* cs = state(comm);
  if (!cs || !device) return ncclInvalidArgument;
  *device = cs->device;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  CommState* cs = state(comm);
  if (!cs || !rank) return ncclInvalidArgument;
  *rank = cs->rank;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

ncclResult_t ncclGroupStart() { return ncclSuccess; }
ncclResult_t ncclGroupEnd() { return ncclSuccess; }

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t t,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
  if (op != ncclSum) return ncclInvalidArgument;
  const std::size_t b = count * elem_size(t);
  return issue(comm, Collective{Kind::kAllReduce, count, t, 0}, send, b, recv, b, s);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount, ncclDataType_t t,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
  CommState* cs = state(comm);
  if (op != ncclSum || !cs) return ncclInvalidArgument;
  const std::size_t b = recvcount * elem_size(t);
  return issue(comm, Collective{Kind::kReduceScatter, recvcount, t, 0}, send,
               b * static_cast<std::size_t>(cs->group->nranks), recv, b, s);
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendcount, ncclDataType_t t,
                           ncclComm_t comm, cudaStream_t s) {
  CommState* cs = state(comm);
  if (!cs) return ncclInvalidArgument;
  const std::size_t b = sendcount * elem_size(t);
  return issue(comm, Collective{Kind::kAllGather, sendcount, t, 0}, send, b, recv,
               b * static_cast<std::size_t>(cs->group->nranks), s);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root,
                           ncclComm_t comm, cudaStream_t s) {
  CommState* cs = state(comm);
  if (!cs || root < 0 || root >= cs->group->nranks) return ncclInvalidArgument;
  const std::size_t b = count * elem_size(t);
  return issue(comm, Collective{Kind::kBroadcast, count, t, root},
               cs->rank == root ? send : nullptr, cs->rank == root ? b : 0, recv, b, s);
}

ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t t,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t s) {
  CommState* cs = state(comm);
  if (op != ncclSum || !cs || root < 0 || root >= cs->group->nranks) return ncclInvalidArgument;
  const std::size_t b = count * elem_size(t);
  return issue(comm, Collective{Kind::kReduce, count, t, root}, send, b,
               cs->rank == root ? recv : nullptr, cs->rank == root ? b : 0, s);
}

}  // extern "C"
