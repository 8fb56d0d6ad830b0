// `strata bench io`: sequential O_DIRECT throughput of an I/O engine at a given block size and
// queue depth (pieces in flight per ring), buffers from 2 MiB-aligned huge-page memory registered
// with the engine. Compared with fio by scripts/bench_fio.sh.
//
// It does no harm: the test file is created (O_EXCL, mode 0600, through the directory's fd) as
// "--dir/.strata-bench-io-<pid>-<random>" and removed afterwards, also on SIGINT/SIGTERM
// (strata/cleanup.hpp) and by `strata clean` after a SIGKILL. With --file it uses that file:
// an existing one is only read, and written (or extended) only with --overwrite; one it creates
// is removed afterwards unless --keep.
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>

#include "cli/command.hpp"
#include "core/safe_fs.hpp"
#include "strata/cleanup.hpp"
#include "strata/error.hpp"
#include "strata/io_engine.hpp"
#include "strata/log.hpp"
#include "strata/units.hpp"
#include "tier/swap_space.hpp"

namespace cmd_bench_io {
namespace {

struct Options {
  std::string dir;
  std::string file;  // optional: use (and keep) this file instead of a temporary one in --dir
  std::string size = "4GiB";
  std::string block_size = "1MiB";
  std::uint32_t queue_depth = 32;
  std::string rw = "read";
  std::string engine = "io_uring";
  std::uint32_t rings = 1;
  std::uint32_t chunks =
      8;  // requests the outstanding queue_depth x rings x block_size is cut into
  std::string direct_io = "required";
  bool overwrite = false;  // --file: allow writing into an existing file
  bool keep = false;       // --file: keep a file that bench io created
  bool json = false;
};

// Refuses directories that are not on a disk: /proc, /sys and the like.
void check_disk_directory(int fd, const std::string& dir) {
  struct statfs st {};
  if (::fstatfs(fd, &st) != 0) throw strata::IoError("statfs", dir, 0, 0, errno, "bench io --dir");
  const char* kind = nullptr;
  switch (static_cast<unsigned long>(st.f_type)) {
    case PROC_SUPER_MAGIC: kind = "proc"; break;
    case SYSFS_MAGIC: kind = "sysfs"; break;
    case DEVPTS_SUPER_MAGIC: kind = "devpts"; break;
    case CGROUP_SUPER_MAGIC: kind = "cgroup"; break;
    case CGROUP2_SUPER_MAGIC: kind = "cgroup2"; break;
    case DEBUGFS_MAGIC: kind = "debugfs"; break;
    case SECURITYFS_MAGIC: kind = "securityfs"; break;
    default: break;
  }
  if (kind)
    strata::fail(strata::ErrorCode::kInvalidArgument,
                 strata::strcat("bench io --dir ", dir, " is on a ", kind,
                                " file system, not on a disk: name a directory on the device to "
                                "measure"));
}

std::string random_hex() {
  std::random_device rd;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
  return buf;
}

// The file bench io works on: opened through its directory's fd, removed at the end when bench
// io created it (and on a signal meanwhile).
struct BenchFile {
  strata::SafeDir dir;
  std::string name;
  std::string path;
  bool created = false;
  bool remove_at_end = false;
  strata::CleanupRegistration on_signal;
  ~BenchFile() {
    if (created && remove_at_end) dir.try_remove(name, false);
  }
};

strata::IoEngineKind parse_engine(const std::string& s) {
  if (auto k = strata::enum_from_name<strata::IoEngineKind>(s)) return *k;
  strata::fail(strata::ErrorCode::kInvalidArgument,
               "--engine must be io_uring, threads or auto, not '" + s + "'");
}

strata::DirectIoMode parse_direct(const std::string& s) {
  if (auto m = strata::enum_from_name<strata::DirectIoMode>(s)) return *m;
  strata::fail(strata::ErrorCode::kInvalidArgument,
               "--direct-io must be auto, required or off, not '" + s + "'");
}

// What killed runs left in --dir (their benchmark files, swap directories), removed as a swap
// space's start-up removes them (tier/swap_space.hpp): a killed `bench io` leaves --size bytes
// that would otherwise stay until `strata clean`.
void remove_leftovers(const strata::SafeDir& dir) {
  using namespace strata;
  for (const auto& l : find_swap_leftovers(dir.path(), true)) {
    if (l.status == SwapLeftover::Status::kRemoved)
      log_info("bench io: removed ", l.path, " left by process ", l.pid,
               " (no longer running): freed ", format_bytes(l.bytes, true));
    else if (l.status == SwapLeftover::Status::kFailed)
      log_warn("bench io: cannot remove ", l.path, " left by process ", l.pid, ": ", l.detail);
  }
}

// The engine options the flags ask for (validated).
strata::IoEngineOptions engine_options(const Options& o) {
  using namespace strata;
  if (o.rw != "read" && o.rw != "write")
    fail(ErrorCode::kInvalidArgument, "--rw must be read or write, not '" + o.rw + "'");
  IoEngineOptions eo;
  eo.kind = parse_engine(o.engine);
  eo.block_size = parse_bytes(o.block_size);
  eo.queue_depth = o.queue_depth;
  eo.io_threads = o.rings;
  eo.direct_io = parse_direct(o.direct_io);
  eo.validate();
  return eo;
}

// Names the file (a temporary one in `dir`, or --file) and checks that an existing --file may be
// used as asked. Returns whether the file exists.
bool choose_file(const Options& o, std::uint64_t size, strata::SafeDir dir, BenchFile& bf) {
  using namespace strata;
  const bool temp = o.file.empty();
  if (temp) {
    remove_leftovers(dir);
    bf.dir = std::move(dir);
    bf.name = strcat(".strata-bench-io-", ::getpid(), "-", random_hex());
  } else {
    const std::string f = normalize_path(o.file);
    const auto slash = f.rfind('/');
    bf.name = slash == std::string::npos ? f : f.substr(slash + 1);
    if (bf.name == "." || bf.name == ".." || bf.name.empty())
      fail(ErrorCode::kInvalidArgument,
           "bench io --file " + o.file + " names a directory, not a file");
    bf.dir = SafeDir::open(slash == std::string::npos ? "."
                           : slash == 0               ? "/"
                                                      : f.substr(0, slash),
                           {.role = "bench io --file"});
  }
  bf.path = bf.dir.child_path(bf.name);
  struct stat existing {};
  const bool exists = !temp && bf.dir.stat_entry(bf.name, &existing);
  if (exists) {
    if (!S_ISREG(existing.st_mode))
      fail(ErrorCode::kInvalidArgument, "bench io --file " + bf.path + " is not a regular file");
    const bool needs_write = o.rw == "write" || static_cast<std::uint64_t>(existing.st_size) < size;
    if (needs_write && !o.overwrite) {
      fail(ErrorCode::kInvalidArgument,
           o.rw == "write"
               ? strcat("bench io --file ", bf.path,
                        " exists: --rw write would overwrite it with "
                        "random data; pass --overwrite to allow that, or name a new file")
               : strcat("bench io --file ", bf.path, " holds ", existing.st_size,
                        " bytes, fewer than --size ", size,
                        ": reading it needs writing it first; "
                        "pass --overwrite to allow that, or lower --size"));
    }
  }
  if (!temp && !exists) {
    log_info("bench io: creating ", bf.path,
             o.keep ? " (kept afterwards: --keep)" : " (removed afterwards)");
  }
  return exists;
}

// Opens the file; one bench io creates is marked for removal (at the end and on a signal).
std::shared_ptr<strata::IoFile> open_file(const Options& o, const strata::IoEngineOptions& eo,
                                          bool exists, BenchFile& bf) {
  using namespace strata;
  IoFileOptions fo;
  fo.create = !exists;
  fo.exclusive = !exists;
  fo.read_only = exists && o.rw == "read" && !o.overwrite;
  fo.direct_io = eo.direct_io;
  auto file = std::make_shared<IoFile>(IoFile::open_at(bf.dir.fd(), bf.name, bf.path, fo));
  if (!exists) {
    const bool temp = o.file.empty();
    bf.created = true;
    bf.remove_at_end = temp || !o.keep;
    bf.on_signal = CleanupRegistration(bf.dir.fd(), bf.name, false);
    // Marks the file as in use for `strata clean` in another process.
    if (temp) ::flock(file->fd(), LOCK_SH | LOCK_NB);
  }
  return file;
}

// Like fio, the benchmark keeps queue_depth x rings x block_size bytes outstanding in a buffer
// of exactly that size (one registered 2 MiB-aligned region): on a host-copied virtual disk the
// buffer's footprint in the caches changes throughput by up to 20 %, so a larger buffer than
// fio's would not compare like with like. The buffer is cut into --chunks requests (each split
// into block_size pieces by the engine), waited for oldest first and resubmitted at once, so
// the engine's queue drops by at most one chunk while this thread wakes up.
class Passes {
 public:
  Passes(strata::IoEngine& engine, strata::FileId id, const Options& o,
         const strata::IoEngineOptions& eo, std::uint64_t size)
      : engine_(engine), id_(id), size_(size) {
    const std::uint64_t pieces_in_flight = std::uint64_t{eo.queue_depth} * eo.io_threads;
    chunks_ = std::min<std::uint64_t>(o.chunks, pieces_in_flight);
    chunk_ = std::min<std::uint64_t>(size, pieces_in_flight / chunks_ * eo.block_size);
    pool_ = strata::IoBuffer::allocate(static_cast<std::size_t>(chunks_ * chunk_));
    std::mt19937_64 rng(42);
    for (std::size_t i = 0; i + 8 <= pool_.size(); i += 8) {
      std::uint64_t v = rng();
      std::memcpy(pool_.bytes() + i, &v, 8);
    }
    strata::IoRegion region{pool_.data(), pool_.size()};
    engine_.register_buffers(std::span<const strata::IoRegion>(&region, 1));
  }

  // One sequential pass over the file.
  void run(strata::IoOp op) {
    const auto timeout = std::chrono::seconds(120);
    std::deque<strata::IoTicket> window;
    std::uint64_t n = 0;
    for (std::uint64_t off = 0; off < size_; off += chunk_, ++n) {
      if (window.size() == chunks_) {
        engine_.wait_for(window.front(), timeout);
        window.pop_front();
      }
      std::uint64_t len = std::min(chunk_, size_ - off);
      window.push_back(engine_.submit({op, id_, pool_.bytes() + (n % chunks_) * chunk_, len, off}));
    }
    engine_.wait_all_for(timeout);
  }

 private:
  strata::IoEngine& engine_;
  const strata::FileId id_;
  const std::uint64_t size_;
  std::uint64_t chunks_ = 0, chunk_ = 0;
  strata::IoBuffer pool_;
};

struct Result {
  double seconds = 0;
  strata::IoStats before, after;
};

void print_result(const Options& o, const strata::IoEngineOptions& eo,
                  const strata::IoEngine& engine, const strata::IoFile& file,
                  const std::string& path, std::uint64_t size, const Result& res) {
  using namespace strata;
  const std::uint64_t bs = eo.block_size;
  const double bps = static_cast<double>(size) / res.seconds;
  if (o.json) {
    nlohmann::json j;
    j["engine"] = engine.name();
    j["rw"] = o.rw;
    j["path"] = path;
    j["size_bytes"] = size;
    j["block_size_bytes"] = bs;
    j["queue_depth"] = eo.queue_depth;
    j["rings"] = eo.io_threads;
    j["direct_io"] = file.direct();
    j["seconds"] = res.seconds;
    j["bytes_per_second"] = bps;
    j["requests"] = res.after.requests - res.before.requests;
    j["retries"] = res.after.retries - res.before.retries;
    j["fixed_buffer_pieces"] = res.after.fixed_pieces - res.before.fixed_pieces;
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << engine.name() << " " << o.rw << ": " << format_bytes(size, true) << " in "
              << res.seconds << " s = " << format_rate(bps) << " (block " << format_bytes(bs, true)
              << ", queue depth " << eo.queue_depth << ", " << eo.io_threads << " ring(s), "
              << (file.direct() ? "O_DIRECT" : "buffered") << ")\n";
  }
}

int run(const Options& o) {
  using namespace strata;
  using clock = std::chrono::steady_clock;
  const IoEngineOptions eo = engine_options(o);
  const std::uint64_t size = parse_bytes(o.size);
  const std::uint64_t bs = eo.block_size;
  if (size == 0 || size % bs != 0)
    fail(ErrorCode::kInvalidArgument,
         strcat("--size ", size, " must be a positive multiple of --block-size ", bs));
  SafeDir dir = SafeDir::open(o.dir, {.role = "bench io --dir"});
  check_disk_directory(dir.fd(), dir.path());

  BenchFile bf;
  const bool exists = choose_file(o, size, std::move(dir), bf);
  auto engine = make_io_engine(eo, bf.dir.path());
  auto file = open_file(o, eo, exists, bf);
  const std::string& path = bf.path;
  FileId id = engine->register_file(file);
  Passes passes(*engine, id, o, eo, size);

  if (o.rw == "read" && file->size() < size) {
    log_info("bench io: writing ", format_bytes(size, true), " to ", path, " first");
    if (bf.created) file->allocate(size);
    passes.run(IoOp::kWrite);
  } else if (o.rw == "write" && bf.created) {
    file->allocate(size);
  }
  Result res;
  res.before = engine->stats();
  auto start = clock::now();
  passes.run(o.rw == "read" ? IoOp::kRead : IoOp::kWrite);
  res.seconds = std::chrono::duration<double>(clock::now() - start).count();
  res.after = engine->stats();
  print_result(o, eo, *engine, *file, path, size, res);
  return 0;
}

const bool kRegistered = strata::cli::register_command(
    {"bench io", "Sequential O_DIRECT throughput of an I/O engine", [](CLI::App& cmd) {
       auto o = std::make_shared<Options>();
       cmd.add_option("--dir", o->dir, "Directory for the test file (and the io_uring probe)")
           ->required();
       auto* file = cmd.add_option(
           "--file", o->file,
           "Use this file instead of a temporary one in --dir: an existing file is only "
           "read unless --overwrite; one bench io creates is removed unless --keep");
       cmd.add_flag(
              "--overwrite", o->overwrite,
              "Allow --rw write (or a read that must lay out data first) into an existing --file")
           ->needs(file);
       cmd.add_flag("--keep", o->keep, "Keep the --file that bench io created")->needs(file);
       cmd.add_option("--size", o->size, "Bytes to transfer (e.g. 4GiB)")->capture_default_str();
       cmd.add_option("--block-size", o->block_size, "Request size")->capture_default_str();
       cmd.add_option("--queue-depth", o->queue_depth, "Requests in flight per ring")
           ->capture_default_str();
       cmd.add_option("--rw", o->rw, "read | write")->capture_default_str();
       cmd.add_option("--engine", o->engine, "io_uring | threads | auto")->capture_default_str();
       cmd.add_option("--rings", o->rings, "io_uring rings (or thread groups)")
           ->capture_default_str();
       cmd.add_option("--chunks", o->chunks,
                      "Requests the queue-depth x rings x block-size bytes in flight are cut into")
           ->capture_default_str()
           ->check(CLI::Range(1u, 1024u));
       cmd.add_option("--direct-io", o->direct_io, "auto | required | off")->capture_default_str();
       cmd.add_flag("--json", o->json, "Print one JSON document");
       return [o]() -> int { return run(*o); };
     }});

}  // namespace
}  // namespace cmd_bench_io
