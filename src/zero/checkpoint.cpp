// Checkpoints of the engine's sharded state (see checkpoint.hpp).
#include "zero/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "strata/io_fault.hpp"
#include "strata/io_file.hpp"
#include "strata/log.hpp"
#include "core/crc32c.hpp"

namespace strata::zero {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'C', 'K'};
constexpr std::uint32_t kVersion = 1;
constexpr std::uint64_t kHeader = 4096;
constexpr std::size_t kPiece = 1 << 20;  // elements per streamed piece
constexpr auto kIoTimeout = std::chrono::minutes(5);
const char* const kSections[5] = {"header", "params", "master", "exp_avg", "exp_avg_sq"};

std::uint64_t round_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

struct Layout {
  std::uint64_t offset[5] = {};
  std::uint64_t bytes[5] = {};
  std::uint64_t total = 0;
};

Layout layout_of(const RankState& s) {
  Layout l;
  const std::uint64_t n = s.store->size() * sizeof(float);
  l.bytes[0] = kHeader;
  l.bytes[1] = s.params.size();
  l.bytes[2] = l.bytes[3] = l.bytes[4] = n;
  std::uint64_t off = 0;
  for (int i = 0; i < 5; ++i) {
    l.offset[i] = off;
    off = round_up(off + l.bytes[i], 4096);
  }
  l.total = off;
  return l;
}

std::string shard_name(std::uint64_t serial, int rank) { return strcat("shard-", serial, "-r", rank, ".bin"); }

void fsync_path(const std::string& path, bool dir) {
  int fd = ::open(path.c_str(), (dir ? O_DIRECTORY : 0) | O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError("open", path, 0, 0, errno, "fsync for the checkpoint");
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw IoError("fsync", path, 0, 0, err, "checkpoint");
}

// Test hook: STRATA_CHECKPOINT_WRITE_DELAY_MS=N delays the completion of every checkpoint write by
// N ms (through the fault-injecting engine), so that a test can kill a process reliably inside a
// save. Unset (the normal case) = no wrapper.
std::unique_ptr<IoEngine> checkpoint_engine() {
  IoEngineOptions o;
  o.kind = IoEngineKind::kThreads;
  o.direct_io = DirectIoMode::kOff;
  o.queue_depth = 8;
  auto engine = make_thread_io_engine(o);
  const char* delay = std::getenv("STRATA_CHECKPOINT_WRITE_DELAY_MS");
  if (delay == nullptr || *delay == '\0') return engine;
  const long ms = std::strtol(delay, nullptr, 10);
  if (ms <= 0) return engine;
  auto faulty = std::make_unique<FaultInjectingIoEngine>(std::move(engine));
  IoFault f = IoFault::delay_nth(1, std::chrono::milliseconds(ms), IoOp::kWrite);
  f.count = 0;  // every write
  faulty->add_fault(f);
  return faulty;
}

json read_manifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / "manifest.json").string();
  std::ifstream in(path);
  if (!in) throw IoError("open", path, 0, 0, errno ? errno : ENOENT, "no checkpoint in this directory");
  try {
    return json::parse(in);
  } catch (const std::exception& e) {
    fail(ErrorCode::kChecksum, strcat("checkpoint manifest ", path, " is not valid JSON: ", e.what()));
  }
}

void put_u64(unsigned char* p, std::uint64_t v) { std::memcpy(p, &v, 8); }

// Runs one batch and waits (the buffers are the caller's until it returns).
void io(IoEngine& e, std::span<const IoRequest> reqs) {
  IoTicket t = e.submit_batch(reqs);
  e.wait_for(t, kIoTimeout);
}

}  // namespace

void save_checkpoint(const std::string& dir, const RankState& s, Communicator& comm) {
  if (!s.store) fail(ErrorCode::kInternal, "checkpoint: no optimizer state store");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw IoError("mkdir", dir, 0, 0, ec.value(), "checkpoint directory");
  std::uint64_t serial = 1;
  if (fs::exists(fs::path(dir) / "manifest.json")) {
    try {
      serial = read_manifest(dir).at("serial").get<std::uint64_t>() + 1;
    } catch (const std::exception& e) {
      log_warn("checkpoint: the existing manifest in ", dir, " is unreadable (", e.what(), "); starting over");
    }
  }
  const Layout l = layout_of(s);
  const std::string path = (fs::path(dir) / shard_name(serial, s.rank)).string();
  auto engine = checkpoint_engine();
  std::uint32_t crc[5] = {};
  {
    IoFileOptions fo;
    fo.create = true;
    fo.direct_io = DirectIoMode::kOff;
    auto file = std::make_shared<IoFile>(IoFile::open(path, fo));
    file->truncate(0);
    FileId id = engine->register_file(file);
    // Header.
    std::vector<unsigned char> header(kHeader, 0);
    std::memcpy(header.data(), kMagic, 8);
    std::memcpy(header.data() + 8, &kVersion, 4);
    const std::uint64_t fields[8] = {serial, static_cast<std::uint64_t>(s.rank), static_cast<std::uint64_t>(s.world),
                                     static_cast<std::uint64_t>(s.stage), static_cast<std::uint64_t>(s.param_dtype),
                                     s.flat_size, s.partition_size, s.store->size()};
    for (int i = 0; i < 8; ++i) put_u64(header.data() + 16 + 8 * i, fields[i]);
    crc[0] = crc32c(header.data(), header.size());
    std::vector<IoRequest> reqs{{IoOp::kWrite, id, header.data(), kHeader, 0}};
    if (!s.params.empty()) {
      crc[1] = crc32c(s.params.data(), s.params.size());
      reqs.push_back({IoOp::kWrite, id, s.params.data(), s.params.size(), l.offset[1]});
    }
    io(*engine, reqs);
    // Optimizer state, streamed from the store in pieces.
    for (std::size_t b = 0; b < s.store->size(); b += kPiece) {
      const Range r{b, std::min(kPiece, s.store->size() - b)};
      StateView v = s.store->acquire(r);
      float* arrays[3] = {v.master, v.exp_avg, v.exp_avg_sq};
      reqs.clear();
      for (int a = 0; a < 3; ++a) {
        crc[2 + a] = crc32c(arrays[a], r.count * sizeof(float), crc[2 + a]);
        reqs.push_back({IoOp::kWrite, id, arrays[a], r.count * sizeof(float), l.offset[2 + a] + b * sizeof(float)});
      }
      try {
        io(*engine, reqs);
      } catch (...) {
        s.store->release(r, false);
        throw;
      }
      s.store->release(r, false);
    }
    file->truncate(l.total);
    file->sync();
    engine->unregister_file(id);
  }
  // Every rank's size and checksums to every rank; rank 0 commits the manifest.
  std::uint32_t mine[8] = {static_cast<std::uint32_t>(l.total), static_cast<std::uint32_t>(l.total >> 32),
                           crc[0], crc[1], crc[2], crc[3], crc[4], 0};
  std::vector<std::uint32_t> all(8 * static_cast<std::size_t>(s.world));
  if (s.world > 1) {
    comm.all_gather(mine, all.data(), 8, DType::kFp32);
  } else {
    std::memcpy(all.data(), mine, sizeof(mine));
  }
  if (s.rank == 0) {
    json m;
    m["format"] = "strata-checkpoint";
    m["version"] = kVersion;
    m["serial"] = serial;
    m["world"] = s.world;
    m["stage"] = s.stage;
    m["param_dtype"] = dtype_name(s.param_dtype);
    m["flat_size"] = s.flat_size;
    m["partition_size"] = s.partition_size;
    m["optimizer_elements"] = s.store->size();
    m["adam_step"] = s.adam_step;
    m["loss_scale"] = s.loss_scale;
    m["good_steps"] = s.good_steps;
    m["steps"] = s.steps;
    m["applied_steps"] = s.applied_steps;
    m["skipped_steps"] = s.skipped_steps;
    m["config"] = s.config_yaml;
    json shards = json::array();
    for (int r = 0; r < s.world; ++r) {
      const std::uint32_t* p = all.data() + 8 * r;
      json sh;
      sh["rank"] = r;
      sh["file"] = shard_name(serial, r);
      sh["bytes"] = static_cast<std::uint64_t>(p[0]) | (static_cast<std::uint64_t>(p[1]) << 32);
      json secs = json::array();
      for (int i = 0; i < 5; ++i)
        secs.push_back({{"name", kSections[i]}, {"offset", l.offset[i]}, {"bytes", l.bytes[i]}, {"crc32c", p[2 + i]}});
      sh["sections"] = secs;
      shards.push_back(sh);
    }
    m["shards"] = shards;
    const std::string tmp = (fs::path(dir) / "manifest.json.tmp").string();
    const std::string final_path = (fs::path(dir) / "manifest.json").string();
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << m.dump(1) << "\n";
      out.flush();
      if (!out) throw IoError("write", tmp, 0, 0, errno ? errno : EIO, "checkpoint manifest");
    }
    fsync_path(tmp, false);
    if (::rename(tmp.c_str(), final_path.c_str()) != 0)
      throw IoError("rename", tmp, 0, 0, errno, strcat("to ", final_path));
    fsync_path(dir, true);
    // The previous checkpoint (and leftovers of killed saves) can go now.
    const std::string keep = strcat("shard-", serial, "-");
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("shard-", 0) == 0 && name.rfind(keep, 0) != 0) fs::remove(e.path(), ec);
    }
    log_info("checkpoint: saved serial ", serial, " (", s.world, " shards) in ", dir);
  }
  comm.barrier();
}

void load_checkpoint(const std::string& dir, RankState& s, Communicator& comm) {
  if (!s.store) fail(ErrorCode::kInternal, "checkpoint: no optimizer state store");
  const json m = read_manifest(dir);
  const std::string mpath = (fs::path(dir) / "manifest.json").string();
  auto bad = [&](const std::string& what) {
    fail(ErrorCode::kInvalidArgument, strcat("checkpoint ", mpath, ": ", what));
  };
  try {
    if (m.at("format") != "strata-checkpoint" || m.at("version").get<std::uint32_t>() != kVersion)
      bad("not a strata checkpoint of version 1");
    const int world = m.at("world").get<int>();
    if (world != s.world)
      bad(strcat("saved by ", world, " ranks, this run has ", s.world,
                 "; loading into another world size is not supported (the shards hold partition slices)"));
    const int stage = m.at("stage").get<int>();
    if ((stage == 0) != (s.stage == 0))
      bad(strcat("saved at zero.stage ", stage, ", this run is at stage ", s.stage,
                 " (stage 0 and stages 1-3 shard differently)"));
    if (m.at("flat_size").get<std::size_t>() != s.flat_size ||
        m.at("partition_size").get<std::size_t>() != s.partition_size ||
        m.at("optimizer_elements").get<std::size_t>() != s.store->size())
      bad("the model's layout (tensors, sizes) differs from the checkpoint's");
    if (m.at("param_dtype").get<std::string>() != dtype_name(s.param_dtype))
      bad(strcat("parameters saved as ", m.at("param_dtype").get<std::string>(), ", this run uses ",
                 dtype_name(s.param_dtype)));
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorCode::kChecksum, strcat("checkpoint manifest ", mpath, " is incomplete: ", e.what()));
  }
  const json* shard = nullptr;
  for (const auto& sh : m.at("shards"))
    if (sh.at("rank").get<int>() == s.rank) shard = &sh;
  if (!shard) bad(strcat("no shard for rank ", s.rank));
  const Layout l = layout_of(s);
  const std::string path = (fs::path(dir) / shard->at("file").get<std::string>()).string();
  auto engine = checkpoint_engine();
  std::shared_ptr<IoFile> file;
  FileId id = 0;
  struct Unreg {
    IoEngine& e;
    FileId id = 0;
    bool on = false;
    ~Unreg() {
      try {
        if (on) e.unregister_file(id);
      } catch (...) {
      }
    }
  } unreg{*engine};
  // Pass 1: verify every section before anything changes; all ranks agree on the verdict.
  std::string problem;
  try {
    IoFileOptions fo;
    fo.read_only = true;
    fo.direct_io = DirectIoMode::kOff;
    file = std::make_shared<IoFile>(IoFile::open(path, fo));
    if (file->size() != shard->at("bytes").get<std::uint64_t>() || file->size() != l.total)
      fail(ErrorCode::kChecksum, strcat("checkpoint shard ", path, ": ", file->size(),
                                        " bytes, the manifest says ", shard->at("bytes").get<std::uint64_t>()));
    id = engine->register_file(file);
    unreg.id = id;
    unreg.on = true;
    std::vector<unsigned char> buf(kPiece * sizeof(float));
    for (int i = 0; i < 5; ++i) {
      const json& sec = shard->at("sections").at(static_cast<std::size_t>(i));
      if (sec.at("offset").get<std::uint64_t>() != l.offset[i] || sec.at("bytes").get<std::uint64_t>() != l.bytes[i])
        fail(ErrorCode::kChecksum, strcat("checkpoint shard ", path, ": section ", kSections[i], " layout differs"));
      std::uint32_t crc = 0;
      for (std::uint64_t off = 0; off < l.bytes[i]; off += buf.size()) {
        const std::uint64_t n = std::min<std::uint64_t>(buf.size(), l.bytes[i] - off);
        io(*engine, std::vector<IoRequest>{{IoOp::kRead, id, buf.data(), n, l.offset[i] + off}});
        crc = crc32c(buf.data(), n, crc);
      }
      if (crc != sec.at("crc32c").get<std::uint32_t>())
        fail(ErrorCode::kChecksum, strcat("checkpoint shard ", path, ": section ", kSections[i], " (offset ",
                                          l.offset[i], ", ", l.bytes[i], " bytes) CRC32C ", crc, " != manifest ",
                                          sec.at("crc32c").get<std::uint32_t>()));
    }
  } catch (const std::exception& e) {
    problem = e.what();
  }
  std::uint32_t ok = problem.empty() ? 1u : 0u;
  std::vector<std::uint32_t> oks(static_cast<std::size_t>(s.world), ok);
  if (s.world > 1) comm.all_gather(&ok, oks.data(), 1, DType::kFp32);
  if (!problem.empty()) fail(ErrorCode::kChecksum, problem);
  for (int r = 0; r < s.world; ++r)
    if (!oks[static_cast<std::size_t>(r)])
      fail(ErrorCode::kChecksum, strcat("checkpoint ", dir, ": rank ", r, "'s shard failed verification; nothing restored"));
  // Pass 2: restore.
  if (!s.params.empty())
    io(*engine, std::vector<IoRequest>{{IoOp::kRead, id, s.params.data(), s.params.size(), l.offset[1]}});
  for (std::size_t b = 0; b < s.store->size(); b += kPiece) {
    const Range r{b, std::min(kPiece, s.store->size() - b)};
    StateView v = s.store->acquire(r);
    float* arrays[3] = {v.master, v.exp_avg, v.exp_avg_sq};
    std::vector<IoRequest> reqs;
    for (int a = 0; a < 3; ++a)
      reqs.push_back({IoOp::kRead, id, arrays[a], r.count * sizeof(float), l.offset[2 + a] + b * sizeof(float)});
    try {
      io(*engine, reqs);
    } catch (...) {
      s.store->release(r, false);
      throw;
    }
    s.store->release(r, true);
  }
  s.adam_step = m.at("adam_step").get<std::int64_t>();
  s.loss_scale = m.at("loss_scale").get<double>();
  s.good_steps = m.at("good_steps").get<std::uint32_t>();
  s.steps = m.at("steps").get<std::uint64_t>();
  s.applied_steps = m.at("applied_steps").get<std::uint64_t>();
  s.skipped_steps = m.at("skipped_steps").get<std::uint64_t>();
}

}  // namespace strata::zero
