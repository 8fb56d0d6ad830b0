// Checkpoints of the engine's sharded state: save, and load with resharding (see checkpoint.hpp).
#include "checkpoint/checkpoint.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <future>
#include <map>
#include <memory>
#include <vector>

#include "checkpoint/format.hpp"
#include "comm/rank_status.hpp"
#include "core/checked_math.hpp"
#include "core/crc32c.hpp"
#include "core/numeric.hpp"
#include "core/printable.hpp"
#include "strata/build_info.hpp"
#include "strata/cleanup.hpp"
#include "strata/error.hpp"
#include "strata/io_file.hpp"
#include "strata/log.hpp"

namespace strata::checkpoint {
namespace {

constexpr std::uint64_t kPiece = 1u << 20;  // elements per streamed piece (rounded to blocks)
// Elements per piece of a save (rounded to blocks): two pieces' state (24 B per element) are in
// host memory at a time, one written while the next is read.
constexpr std::uint64_t kSavePiece = 2u << 20;
// Bytes copied into a piece's staging at a time, then checksummed while still in the cache.
constexpr std::uint64_t kCopyChunk = 256u << 10;

void check_state(const RankState& s, const char* what) {
  if (!s.store || !s.partition)
    fail(ErrorCode::kInternal,
         strcat("checkpoint ", what, ": no optimizer state store or partition"));
  const std::size_t want = s.params_in_store ? 0 : s.store->size() * dtype_size(s.param_dtype);
  if (s.params.size() != want)
    fail(ErrorCode::kInternal,
         strcat("checkpoint ", what, ": ", s.params.size(), " parameter bytes for ",
                s.store->size(), " optimizer elements"));
  if (s.partition->world() != s.world || s.partition->flat_size() != s.flat_size ||
      s.partition->partition_size() != s.partition_size ||
      s.opt_begin + s.store->size() > s.flat_size)
    fail(ErrorCode::kInternal, strcat("checkpoint ", what, ": inconsistent rank layout"));
}

// The file seam of this rank's checkpoint files (tests hand in a FaultInjectingFileEnv).
FileEnv& env_of(const RankState& s) { return s.env ? *s.env : FileEnv::current(); }

// ---- agreement between ranks
// -----------------------------------------------------------------------

// This rank's outcome of a phase; `extra` carries one value per rank (a checksum, a size).
struct Outcome {
  std::exception_ptr error;
  std::uint64_t extra = 0;
  void capture() { error = std::current_exception(); }
};

// The exchange of `bytes` bytes per rank (host memory in and out) where the communicator's buffers
// live: through the engine's staging (RankState::all_gather), or directly on the host arrays for a
// host-buffer communicator. A device-buffer communicator without staging is refused on every rank
// alike (each sees the same communicator), before the collective: nothing hangs.
void all_gather_bytes(Communicator& comm, const RankState& s, const void* send, void* recv,
                      std::size_t bytes) {
  if (s.all_gather) {
    s.all_gather(send, recv, bytes);
    return;
  }
  if (comm.buffer_location() != BufferLocation::kHost)
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint: the ", comm.backend_name(),
                " communicator takes device memory; the ranks' agreement needs "
                "RankState::all_gather to stage it"));
  comm.all_gather(send, recv, bytes / 4, DType::kFp32);  // raw 32-bit words, no arithmetic
}

// Returns every rank's extra; throws on every rank when any rank failed: the rank's own error, or
// an error with the failed rank's code naming it.
std::vector<std::uint64_t> agree(Communicator& comm, const RankState& s, const Outcome& mine,
                                 const std::string& what) {
  RankStatus status = RankStatus::of(mine.error);
  status.extra = mine.extra;
  const auto all =
      exchange_status(status, s.world, [&](const void* send, void* recv, std::size_t bytes) {
        all_gather_bytes(comm, s, send, recv, bytes);
      });
  if (mine.error) std::rethrow_exception(mine.error);
  std::vector<std::uint64_t> extras(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].failed)
      fail(all[r].code, strcat(what, ": rank ", r, " failed (", error_code_name(all[r].code),
                               "; see that rank's error); nothing was changed"));
    extras[r] = all[r].extra;
  }
  return extras;
}

// ---- save
// ------------------------------------------------------------------------------------------

// A `manifest.json` that is not a checkpoint strata wrote (unparsable, failing its seal, of another
// format, a link) is never replaced: the save is refused (exit code 2) before anything changes.
[[noreturn]] void refuse_foreign_manifest(const SafeDir& dir, const std::exception& e) {
  fail(ErrorCode::kInvalidArgument,
       strcat("checkpoint save into ", dir.path(), ": ", dir.child_path(kManifestName),
              " is not a checkpoint strata wrote (", e.what(),
              "); it is not replaced and nothing was changed: move it away or save elsewhere"));
}

// The next serial: above the committed manifest's and above every shard file present (leftovers of
// killed saves), so that a new shard never meets an old file of its name.
std::uint64_t next_serial(const SafeDir& dir, FileEnv& env) {
  std::uint64_t serial = 0;
  struct stat st {};
  if (dir.stat_entry(kManifestName, &st)) {
    try {
      serial = read_manifest(dir, env).serial;
    } catch (const IoError& e) {
      if (!e.bad_path()) throw e.with_context(strcat("checkpoint save into ", dir.path()));
      refuse_foreign_manifest(dir, e);
    } catch (const std::exception& e) {
      refuse_foreign_manifest(dir, e);
    }
  }
  for (const std::string& name : dir.entries()) {
    std::uint64_t s = 0;
    if (checkpoint_file_serial(name, &s)) serial = std::max(serial, s);
  }
  return serial + 1;
}

// The directory's save lock (rank 0 of a run): an exclusive flock on a descriptor of the
// directory of its own, and the owner's pid in kOwnerName while it is held. Held from begin_save
// until the PendingSave goes (committed, failed or abandoned); the kernel releases it when the
// process dies. Written with plain calls (not the FileEnv seam: no file operation of the save).
constexpr const char* kOwnerName = "writer.pid";

class SaveLock {
 public:
  explicit SaveLock(SafeDir dir) : dir_(std::move(dir)) {}
  SaveLock(const SaveLock&) = delete;
  SaveLock& operator=(const SaveLock&) = delete;
  ~SaveLock() { dir_.try_remove(kOwnerName, false); }  // then the descriptor closes: unlocked

 private:
  SafeDir dir_;
};

// The pid kOwnerName names, or 0 (absent, unreadable, not a pid).
long owner_pid(const SafeDir& dir) {
  try {
    const UniqueFd fd = dir.open_file(kOwnerName, O_RDONLY);
    char buf[32] = {};
    const ssize_t n = ::read(fd.get(), buf, sizeof buf - 1);
    if (n <= 4 || std::strncmp(buf, "pid ", 4) != 0) return 0;
    return std::strtol(buf + 4, nullptr, 10);
  } catch (const std::exception&) {
    return 0;
  }
}

std::shared_ptr<void> lock_for_saving(const SafeDir& dir) {
  SafeDirOptions opt;
  opt.role = "checkpoint directory";
  SafeDir own = SafeDir::open(dir.path(), opt);
  if (::flock(own.fd(), LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err != EWOULDBLOCK)
      throw IoError("flock", dir.path(), 0, 0, err, "checkpoint save: locking the directory");
    const long pid = owner_pid(dir);
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint save into ", dir.path(),
                ": the directory is in use by another run saving into it (",
                pid > 0 ? strcat("pid ", pid, pid == ::getpid() ? ", this process" : "")
                        : std::string("its pid unknown"),
                ", per ", dir.child_path(kOwnerName),
                "); nothing was changed: save elsewhere or wait for that run to end"));
  }
  own.try_remove(kOwnerName, false);  // a leftover of a killed owner
  const UniqueFd fd = own.create_file(kOwnerName, O_WRONLY);
  const std::string text = strcat("pid ", ::getpid(), "\n");
  if (::write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size()))
    throw IoError("write", own.child_path(kOwnerName), 0, text.size(), errno ? errno : EIO);
  return std::make_shared<SaveLock>(std::move(own));
}

// The training counters a checkpoint carries, from RankState into the Manifest and back.
void copy_counters(const TrainingCounters& from, TrainingCounters& to) { to = from; }

Manifest skeleton(const RankState& s, std::uint64_t serial, std::uint64_t block_elems) {
  Manifest m;
  m.strata_version = build::kVersion;
  m.serial = serial;
  m.world = s.world;
  m.stage = s.stage;
  m.param_dtype = s.param_dtype;
  m.flat_size = s.flat_size;
  m.partition_size = s.partition_size;
  m.block_elems = block_elems;
  const Partition& p = *s.partition;
  for (std::size_t i = 0; i < p.num_tensors(); ++i)
    m.tensors.push_back({p.tensor(i).name, p.tensor(i).numel, p.offset(i)});
  copy_counters(s, m);
  m.config_yaml = s.config_yaml;
  if (s.model) set_model(m, *s.model, s.rank == 0);
  const ShardLayout l = shard_layout(s.partition_size, s.param_dtype, block_elems);
  for (int r = 0; r < s.world; ++r) {
    ShardEntry e;
    e.rank = r;
    e.file = shard_file_name(serial, r);
    e.bytes = l.total;
    e.begin = static_cast<std::uint64_t>(r) * s.partition_size;
    e.count = s.partition_size;
    m.shards.push_back(e);
  }
  return m;
}

// The writes of one piece of a shard (a slice of each section), each on a thread of its own, all
// in flight at once, while the caller checksums the next piece and the store reads the one after
// (write_pieces). The shard file is direct (WriteMode::kDirect): each write goes to the disk as it
// is made, without a copy into the page cache, and the disk has several to work on. One batch at
// a time: wait() before the next submit() (and before the batch's buffers are reused); the
// destructor waits too (dropping an error: the save is failing already).
class WriteBehind {
 public:
  struct Write {
    const void* data;
    std::uint64_t n, offset;
  };
  explicit WriteBehind(WritableFile& file) : file_(file) {}
  ~WriteBehind() {
    try {
      wait();
    } catch (...) {
    }
  }
  void submit(const std::vector<Write>& batch) {
    for (const Write& w : batch)
      pending_.push_back(
          std::async(std::launch::async, [this, w] { file_.write_at(w.data, w.n, w.offset); }));
  }
  void wait() {  // waits for every write of the batch; rethrows the first failure
    std::exception_ptr first;
    for (std::future<void>& f : pending_) {
      try {
        f.get();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    pending_.clear();
    if (first) std::rethrow_exception(first);
  }

 private:
  WritableFile& file_;
  std::vector<std::future<void>> pending_;
};

// The CRC32C of each block of each section of a shard, in order; a section's last block's CRC
// also covers the zero padding after the section.
class BlockCrcs {
 public:
  BlockCrcs(const ShardLayout& l, std::uint64_t block_elems) : l_(l), be_(block_elems) {
    for (auto& c : crcs_) c.reserve(l.nblocks);
  }
  // Checksums the next `n` elements of section `sec`, at `p`; with `copy_to`, copies them there
  // first, a chunk at a time (checksummed while in the cache). Returns where they are now.
  const unsigned char* add(int sec, const unsigned char* p, std::uint64_t n,
                           unsigned char* copy_to = nullptr) {
    const std::uint64_t eb = l_.elem_bytes[sec];
    const unsigned char* from = copy_to ? copy_to : p;
    for (std::uint64_t b = 0; b < n; b += be_) {
      const std::uint64_t at = b * eb, bytes = std::min(be_, n - b) * eb;
      std::uint32_t c = 0;
      for (std::uint64_t o = 0; o < bytes; o += kCopyChunk) {
        const std::uint64_t k = std::min(kCopyChunk, bytes - o);
        if (copy_to) std::memcpy(copy_to + at + o, p + at + o, k);
        c = crc32c(from + at + o, k, c);
      }
      if (crcs_[sec].size() + 1 == l_.nblocks)
        c = crc32c(zeros_.data(), l_.padded[sec] - l_.bytes[sec], c);
      crcs_[sec].push_back(c);
    }
    return from;
  }
  const std::vector<std::uint32_t> (&crcs() const)[kSections] { return crcs_; }

 private:
  const ShardLayout& l_;
  const std::uint64_t be_;
  const std::vector<unsigned char> zeros_ = std::vector<unsigned char>(4096, 0);
  std::vector<std::uint32_t> crcs_[kSections];
};

// Page-aligned copies of one piece of every section, two of them (piece k's in set k % 2: one
// written while the next is filled), for the slices of a direct file that cannot go straight from
// the views: O_DIRECT needs page-aligned memory and lengths. The store's views are page-aligned
// (RangeReads); the parameters from the caller's span may not be, and a section's last slice is
// padded. Allocated on first use: at most 2 x piece x (parameter bytes + 12), 56 MiB at 16-bit
// parameters, for the length of a save.
class PieceStaging {
 public:
  PieceStaging(const ShardLayout& l, std::uint64_t piece) {
    for (int sec = 0; sec < kSections; ++sec) {
      offset_[sec] = bytes_;
      bytes_ += round_up(piece * l.elem_bytes[sec], kDirectAlignment);
    }
  }
  unsigned char* at(std::uint64_t k, int sec) {
    IoBuffer& set = sets_[k % 2];
    if (!set) set = IoBuffer::allocate(bytes_);
    return set.bytes() + offset_[sec];
  }
  // A section's last `bytes`, staged at `p`, written with the zero padding up to the alignment
  // (the format's padding: sections are padded to kSectionAlign): the write stays direct.
  static std::uint64_t pad_last(unsigned char* p, std::uint64_t bytes) {
    static_assert(kSectionAlign % kDirectAlignment == 0);
    const std::uint64_t padded = round_up(bytes, kDirectAlignment);
    std::memset(p + bytes, 0, padded - bytes);
    return padded;
  }

 private:
  std::uint64_t bytes_ = 0;
  std::uint64_t offset_[kSections] = {};
  IoBuffer sets_[2];
};

// The optimizer state streamed from the store (whatever tier it lives in) piece by piece, with
// the parameters (straight from the span, or from the store's views): each piece checksummed
// (and staged, for a direct file) while the previous one is written and the next one read.
void write_pieces(const ShardLayout& l, const ShardEntry& e, const RankState& s,
                  std::uint64_t block_elems, WritableFile& file, BlockCrcs& crcs) {
  const std::uint64_t base = e.begin - s.opt_begin;  // the shard's first element in the store
  const std::uint64_t pes = l.elem_bytes[kParams], piece = round_up(kSavePiece, block_elems);
  struct DropPrefetch {  // however this ends, no prefetched range outlives the save
    OptimizerStateStore* store;
    ~DropPrefetch() { store->drop_prefetch(); }
  } drop_prefetch{s.store};
  PieceStaging staging(l, piece);
  WriteBehind behind(file);  // (waits before the guard drops the prefetch)
  for (std::uint64_t b = 0, k = 0; b < e.count; b += piece, ++k) {
    const std::uint64_t n = std::min(piece, e.count - b);
    // Section `sec`'s slice of this piece, checksummed (and staged where the write could not be
    // direct from `data`): its write.
    const auto slice = [&](int sec, const void* data) -> WriteBehind::Write {
      const auto* p = static_cast<const unsigned char*>(data);
      const std::uint64_t eb = l.elem_bytes[sec], bytes = n * eb, at = l.offset[sec] + b * eb;
      if (!file.direct() || direct_aligned(p, bytes, at)) return {crcs.add(sec, p, n), bytes, at};
      unsigned char* copy = staging.at(k, sec);
      crcs.add(sec, p, n, copy);
      return {copy, b + n == e.count ? PieceStaging::pad_last(copy, bytes) : bytes, at};
    };
    const Range r{base + b, n};
    StateView v = s.store->acquire(r);
    try {
      const unsigned char* p = s.params_in_store ? v.params : s.params.data() + (base + b) * pes;
      if (!p) fail(ErrorCode::kInternal, "checkpoint save: the store's views hold no parameters");
      const std::vector<WriteBehind::Write> batch{slice(kParams, p), slice(kMaster, v.master),
                                                  slice(kExpAvg, v.exp_avg),
                                                  slice(kExpAvgSq, v.exp_avg_sq)};
      behind.wait();  // the previous piece is written: the prefetch may reuse its buffers
      if (b + n < e.count) s.store->prefetch({base + b + n, std::min(piece, e.count - b - n)});
      behind.submit(batch);
    } catch (...) {
      s.store->release(r, false);
      throw;
    }
    s.store->release(r, false);  // (the views stay readable until the next prefetch)
  }
  behind.wait();
}

// A checkpoint file created for writing, registered for removal on a signal for as long as it is
// open: a SIGTERM / SIGINT while it is written (the `strata` command's handler) removes it with
// the swap files, so the save is abandoned and the previous checkpoint stays. Registered before
// it exists, and removed here when the handler already ran (the process is ending: the handler's
// pass may have come before the file did).
class RegisteredFile final : public WritableFile {
 public:
  RegisteredFile(const SafeDir& dir, const std::string& name, const RankState& s)
      : on_signal_(dir.fd(), name, false) {
    // A signal's cleanup (run_signal_cleanup(true)) waits while this is held: it sets the ending
    // flag, removes what exists, then waits; so either the check before the create sees the flag,
    // or the one after does and this removes the file before the process ends.
    const CleanupCreation creating;
    if (!signal_cleanup_ending()) {
      file_ = env_of(s).create_file(dir, name, 0600, WriteMode::kDirect);
      if (!signal_cleanup_ending()) return;
      file_.reset();
      dir.try_remove(name, false);
    }
    fail(ErrorCode::kCancelled, strcat("checkpoint save: ", dir.path(), "/", name,
                                       " not written: the process is ending (signal)"));
  }
  const std::string& path() const override { return file_->path(); }
  void write_at(const void* data, std::uint64_t n, std::uint64_t offset) override {
    file_->write_at(data, n, offset);
  }
  void truncate(std::uint64_t size) override { file_->truncate(size); }
  void sync() override { file_->sync(); }
  bool direct() const override { return file_->direct(); }

 private:
  CleanupRegistration on_signal_;
  std::unique_ptr<WritableFile> file_;
};

std::unique_ptr<WritableFile> create_registered(const SafeDir& dir, const std::string& name,
                                                const RankState& s) {
  return std::make_unique<RegisteredFile>(dir, name, s);
}

// Writes this rank's shard; returns the header's CRC32C.
std::uint32_t write_shard(const SafeDir& dir, const Manifest& m, const RankState& s) {
  const ShardEntry& e = m.shards[static_cast<std::size_t>(s.rank)];
  const ShardLayout l = shard_layout(e.count, m.param_dtype, m.block_elems);
  if (e.begin < s.opt_begin || e.begin + e.count > s.opt_begin + s.store->size())
    fail(ErrorCode::kInternal,
         strcat("checkpoint: rank ", s.rank, " does not hold its shard's range"));
  dir.try_remove(e.file, false);  // a leftover of a killed save of this serial
  const std::unique_ptr<WritableFile> file = create_registered(dir, e.file, s);
  BlockCrcs crcs(l, m.block_elems);
  write_pieces(l, e, s, m.block_elems, *file, crcs);
  const std::vector<unsigned char> header = encode_shard_header(m, s.rank, l, crcs.crcs());
  file->write_at(header.data(), header.size(), 0);
  file->truncate(l.total);
  file->sync();
  return crc32c(header.data(), header.size());
}

// Rank 0: the extra tensors, back to back, as set_model laid them out.
void write_extra(const SafeDir& dir, const Manifest& m, const RankState& s) {
  if (m.extra_file.empty()) return;
  dir.try_remove(m.extra_file, false);  // a leftover of a killed save of this serial
  const std::unique_ptr<WritableFile> file = create_registered(dir, m.extra_file, s);
  for (std::size_t i = 0; i < m.extra.size(); ++i) {
    const auto& data = s.model->extra[i].data;
    for (std::uint64_t done = 0; done < data.size();) {
      const std::uint64_t n = std::min<std::uint64_t>(data.size() - done, kPiece);
      file->write_at(data.data() + done, n, m.extra[i].offset + done);
      done += n;
    }
  }
  file->truncate(m.extra_bytes);
  file->sync();
}

void commit_manifest(const SafeDir& dir, const Manifest& m, FileEnv& env) {
  // (A leftover manifest.json.tmp of a killed save, or anything planted there, is removed first.)
  write_file_atomically(env, dir, kManifestName, kManifestTmpName, serialize_manifest(m));
  // The previous checkpoint (and leftovers of killed saves) can go now.
  for (const std::string& name : dir.entries()) {
    std::uint64_t serial = 0;
    if (checkpoint_file_serial(name, &serial) && serial != m.serial) dir.try_remove(name, false);
  }
}

// ---- load
// ------------------------------------------------------------------------------------------

// A run of this rank's range: `count` elements at `dst` (offset in the store's range) come from
// shard `shard` at element `src` of that shard, or are padding (shard -1: zero).
struct Segment {
  std::uint64_t dst = 0, count = 0;
  int shard = -1;
  std::uint64_t src = 0;
};

// Which saved tensor each of this model's tensors is (checked: the same name and size): the one
// at its position, or — the same tensors registered in another order (strata.torch registered
// them group by group before 2026-12-05, in the model's order since) — the one of its name, where
// the saved names are unique. Anything else is another model: refused naming the first mismatch.
std::vector<std::size_t> check_model(const Manifest& m, const RankState& s) {
  const Partition& p = *s.partition;
  if (m.param_dtype != s.param_dtype)
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint ", m.path, ": field 'param_dtype': parameters saved as ",
                dtype_name(m.param_dtype), ", this run uses precision.params ",
                dtype_name(s.param_dtype)));
  if (m.tensors.size() != p.num_tensors())
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint ", m.path, ": field 'tensors': ", m.tensors.size(),
                " tensors saved, this model registers ", p.num_tensors()));
  std::map<std::string, std::size_t> by_name;
  for (std::size_t j = 0; j < m.tensors.size(); ++j) by_name.emplace(m.tensors[j].name, j);
  const bool unique = by_name.size() == m.tensors.size();
  std::vector<std::size_t> saved(m.tensors.size());
  std::vector<bool> taken(m.tensors.size(), false);
  for (std::size_t i = 0; i < m.tensors.size(); ++i) {
    std::size_t j = i;
    if (m.tensors[i].name != p.tensor(i).name && unique) {
      const auto it = by_name.find(p.tensor(i).name);
      if (it != by_name.end() && !taken[it->second]) j = it->second;
    }
    taken[j] = true;
    if (m.tensors[j].name != p.tensor(i).name || m.tensors[j].numel != p.tensor(i).numel)
      fail(ErrorCode::kInvalidArgument,
           strcat("checkpoint ", m.path, ": field 'tensors[", j, "]': saved '",
                  printable(m.tensors[j].name, 200), "' (", m.tensors[j].numel,
                  " elements), this model registers '", p.tensor(i).name, "' (", p.tensor(i).numel,
                  " elements) there"));
    saved[i] = j;
  }
  return saved;
}

std::vector<Segment> plan_segments(const Manifest& m, const RankState& s,
                                   const std::vector<std::size_t>& saved) {
  const Partition& p = *s.partition;
  const std::uint64_t begin = s.opt_begin, end = begin + s.store->size();
  std::vector<Segment> out;
  std::uint64_t pos = begin;
  for (std::size_t i = 0; i < p.num_tensors(); ++i) {
    const std::uint64_t off = p.offset(i), x0 = std::max<std::uint64_t>(begin, off);
    const std::uint64_t x1 = std::min<std::uint64_t>(end, off + p.tensor(i).numel);
    if (x0 >= x1) continue;
    if (pos < x0) out.push_back({pos - begin, x0 - pos, -1, 0});
    std::uint64_t old = m.tensors[saved[i]].offset + (x0 - off);
    for (std::uint64_t x = x0; x < x1;) {
      const auto shard = static_cast<int>(old / m.partition_size);
      const std::uint64_t take =
          std::min(x1 - x, (static_cast<std::uint64_t>(shard) + 1) * m.partition_size - old);
      out.push_back(
          {x - begin, take, shard, old - static_cast<std::uint64_t>(shard) * m.partition_size});
      x += take;
      old += take;
    }
    pos = x1;
  }
  if (pos < end) out.push_back({pos - begin, end - pos, -1, 0});
  return out;
}

// The extra file (what the load does not restore, but the checkpoint holds) is there, of its size.
void check_extra_file(const SafeDir& dir, const Manifest& m, FileEnv& env) {
  if (m.extra_file.empty()) return;
  open_extra_file(dir, m, env);
}

// Open shard readers, one per saved shard at most, opened when first needed.
class Shards {
 public:
  Shards(const SafeDir& dir, const Manifest& m, FileEnv& env)
      : dir_(dir), m_(m), env_(env), readers_(m.shards.size()) {}
  ShardReader& at(int shard) {
    auto& r = readers_[static_cast<std::size_t>(shard)];
    if (!r) r = std::make_unique<ShardReader>(dir_, m_, shard, env_);
    if (shard != current_) {  // shards are visited in ascending order: free the previous cache
      if (current_ >= 0 && readers_[static_cast<std::size_t>(current_)])
        readers_[static_cast<std::size_t>(current_)]->drop_cache();
      current_ = shard;
    }
    return *r;
  }
  std::uint64_t bytes_read() const {
    std::uint64_t n = 0;
    for (const auto& r : readers_)
      if (r) n += r->bytes_read();
    return n;
  }

 private:
  const SafeDir& dir_;
  const Manifest& m_;
  FileEnv& env_;
  std::vector<std::unique_ptr<ShardReader>> readers_;
  int current_ = -1;
};

}  // namespace

PendingSave begin_save(const std::string& dir_path, const RankState& s, Communicator& comm,
                       const SaveOptions& options) {
  check_state(s, "save");
  const std::uint64_t block_elems = options.block_elems ? options.block_elems : kDefaultBlockElems;
  if (block_elems > kMaxBlockElems)
    fail(ErrorCode::kInvalidArgument,
         strcat("checkpoint save: block_elems ", block_elems, " is more than the ", kMaxBlockElems,
                " a checkpoint may have"));
  // The directory (created if missing), and the serial (rank 0's, for every rank).
  PendingSave p;
  p.path = dir_path;
  Outcome o;
  try {
    SafeDirOptions opt;
    opt.create = true;
    opt.role = "checkpoint directory";
    if (s.rank == 0) {
      p.dir = SafeDir::open(dir_path, opt);
      p.lock = lock_for_saving(p.dir);
      o.extra = next_serial(p.dir, env_of(s));
    }
  } catch (...) {
    o.capture();
  }
  const std::uint64_t serial = agree(comm, s, o, strcat("checkpoint save into ", dir_path))[0];
  p.manifest = skeleton(s, serial, block_elems);
  // The tensors the engine does not train (CheckpointModel::extra, borrowed for the call): rank 0
  // writes them here, on the caller's thread, whatever the mode; a failure is the save's
  // (finish_save reports it on every rank).
  if (s.rank == 0) {
    try {
      write_extra(p.dir, p.manifest, s);
    } catch (...) {
      p.extra_error = std::current_exception();
      p.dir.try_remove(extra_file_name(serial), false);
    }
  }
  return p;
}

std::uint32_t write_shard(const PendingSave& p, const RankState& s) {
  SafeDir opened;
  const SafeDir* dir = &p.dir;
  try {
    if (s.rank != 0) {
      opened = SafeDir::open(p.path, {});
      dir = &opened;
    }
    return write_shard(*dir, p.manifest, s);
  } catch (...) {
    if (*dir) dir->try_remove(shard_file_name(p.manifest.serial, s.rank), false);
    throw;
  }
}

namespace {

// Rank 0: the manifest with every shard's header CRC committed; a failure is captured in `o`.
void commit_on_rank0(PendingSave& p, const RankState& s, Outcome& o) {
  try {
    commit_manifest(p.dir, p.manifest, env_of(s));
    log_info("checkpoint: saved serial ", p.manifest.serial, " (", s.world, " shards, stage ",
             s.stage, ") in ", p.dir.path());
  } catch (...) {
    o.capture();
  }
}

// The header of shard `rank` as its writer left it (durable): its CRC32C. The file must be of the
// manifest's size (a shard cut short is not durable).
std::uint32_t shard_header_crc(const PendingSave& p, const RankState& s, int rank) {
  const ShardEntry& e = p.manifest.shards[static_cast<std::size_t>(rank)];
  const ShardLayout l = shard_layout(e.count, p.manifest.param_dtype, p.manifest.block_elems);
  const std::unique_ptr<RandomAccessFile> f = env_of(s).open_file(p.dir, e.file);
  const struct stat st = f->status();
  if (!S_ISREG(st.st_mode) || static_cast<std::uint64_t>(st.st_size) != e.bytes)
    fail(ErrorCode::kChecksum, strcat("checkpoint save into ", p.path, ": shard ", f->path(),
                                      " is ", st.st_size, " bytes, its writer wrote ", e.bytes));
  std::vector<unsigned char> h(l.header_bytes);
  f->read_at(h.data(), h.size(), 0);
  return crc32c(h.data(), h.size());
}

}  // namespace

void finish_save(PendingSave& p, const RankState& s, Communicator& comm, std::exception_ptr error,
                 std::uint32_t header_crc) {
  const std::string what = strcat("checkpoint save into ", p.path);
  Outcome o;
  o.error = error ? error : p.extra_error;
  o.extra = header_crc;
  const std::vector<std::uint64_t> crcs = agree(comm, s, o, what);
  // Rank 0 commits; everyone learns whether it did.
  o = Outcome{};
  if (s.rank == 0) {
    for (int r = 0; r < s.world; ++r)
      p.manifest.shards[static_cast<std::size_t>(r)].header_crc32c =
          static_cast<std::uint32_t>(crcs[static_cast<std::size_t>(r)]);
    commit_on_rank0(p, s, o);
  }
  agree(comm, s, o, what);
}

std::exception_ptr commit_durable_save(PendingSave& p, const RankState& s) {
  if (s.rank != 0) return nullptr;
  Outcome o;
  if (p.extra_error) return p.extra_error;
  try {
    for (int r = 0; r < s.world; ++r)
      p.manifest.shards[static_cast<std::size_t>(r)].header_crc32c = shard_header_crc(p, s, r);
  } catch (...) {
    return std::current_exception();
  }
  commit_on_rank0(p, s, o);
  return o.error;
}

void finish_committed_save(const PendingSave& p, const RankState& s, Communicator& comm,
                           std::exception_ptr commit_error) {
  Outcome o;
  o.error = commit_error;
  agree(comm, s, o, strcat("checkpoint save into ", p.path));
}

void save_checkpoint(const std::string& dir_path, const RankState& s, Communicator& comm,
                     const SaveOptions& options) {
  PendingSave p = begin_save(dir_path, s, comm, options);
  std::exception_ptr error;
  std::uint32_t crc = 0;
  try {
    crc = write_shard(p, s);
  } catch (...) {
    error = std::current_exception();
  }
  finish_save(p, s, comm, error, crc);
}

namespace {

// Whether n loaded parameters are bitwise their masters rounded to `dt` (store_elem).
bool params_follow(const unsigned char* params, const float* master, std::uint64_t n, DType dt) {
  const std::size_t pes = dtype_size(dt);
  unsigned char want[4];
  for (std::uint64_t i = 0; i < n; ++i) {
    store_elem(want, 0, dt, master[i]);
    if (std::memcmp(want, params + i * pes, pes) != 0) return false;
  }
  return true;
}

// Pass 2, one piece of the store: the segments that overlap it read from their shards (zero where
// no shard holds them: padding); clears s.params_follow_master where a parameter is not its
// master's rounding.
void restore_piece(RankState& s, Range range, const std::vector<Segment>& segs, std::size_t* first,
                   Shards& shards) {
  const std::uint64_t pes = dtype_size(s.param_dtype), p = range.begin;
  StateView v = s.store->acquire(range);
  try {
    float* arrays[3] = {v.master, v.exp_avg, v.exp_avg_sq};
    std::size_t& k = *first;  // first segment that may overlap the piece
    while (k < segs.size() && segs[k].dst + segs[k].count <= p) ++k;
    for (std::size_t i = k; i < segs.size() && segs[i].dst < range.end(); ++i) {
      const Segment& g = segs[i];
      const std::uint64_t x0 = std::max(g.dst, p), x1 = std::min(g.dst + g.count, range.end());
      unsigned char* params = s.params.data() + x0 * pes;
      if (g.shard < 0) {
        for (float* a : arrays) std::memset(a + (x0 - p), 0, (x1 - x0) * sizeof(float));
        std::memset(params, 0, (x1 - x0) * pes);
        continue;
      }
      ShardReader& r = shards.at(g.shard);
      const std::uint64_t src = g.src + (x0 - g.dst);
      r.read(kParams, src, x1 - x0, params);
      for (int a = 0; a < 3; ++a)
        r.read(static_cast<Section>(kMaster + a), src, x1 - x0, arrays[a] + (x0 - p));
      if (s.params_follow_master &&
          !params_follow(params, v.master + (x0 - p), x1 - x0, s.param_dtype))
        s.params_follow_master = false;
    }
  } catch (...) {
    s.store->release(range, false);
    throw;
  }
  s.store->release(range, true);
}

}  // namespace

void load_checkpoint(const std::string& dir_path, RankState& s, Communicator& comm) {
  check_state(s, "load");
  s.restore_started = false;
  s.bytes_read = s.bytes_verified = s.bytes_restored = 0;
  s.params_follow_master = true;
  const std::string what = strcat("checkpoint load from ", dir_path);
  SafeDir dir;
  Manifest m;
  std::vector<Segment> segs;
  std::vector<std::size_t> saved;  // this model's tensor i is the saved tensor saved[i]
  std::unique_ptr<Shards> shards;
  // Pass 1: the manifest, the model, and every block this rank needs; nothing changes.
  Outcome o;
  try {
    dir = SafeDir::open(dir_path, {});
    m = read_manifest(dir, env_of(s));
    o.extra = m.crc32c;
    saved = check_model(m, s);
    segs = plan_segments(m, s, saved);
    shards = std::make_unique<Shards>(dir, m, env_of(s));
    for (const Segment& g : segs) {
      if (g.shard < 0) continue;
      ShardReader& r = shards->at(g.shard);
      for (int sec = 0; sec < kSections; ++sec) r.verify(static_cast<Section>(sec), g.src, g.count);
    }
    // Every shard is present, of its size, with its header, even if nobody reads it.
    if (s.rank == 0) {
      for (int j = 0; j < m.world; ++j) shards->at(j);
      check_extra_file(dir, m, env_of(s));
    }
  } catch (...) {
    o.capture();
  }
  if (shards) s.bytes_read = s.bytes_verified = shards->bytes_read();
  const std::vector<std::uint64_t> crcs = agree(comm, s, o, what);
  for (int r = 1; r < s.world; ++r)
    if (crcs[static_cast<std::size_t>(r)] != crcs[0])
      fail(ErrorCode::kChecksum,
           strcat(what, ": ranks 0 and ", r, " read different manifests (the checkpoint ",
                  "changed during the load?); nothing was changed"));
  // Pass 2: restore, piece by piece of the store.
  s.restore_started = true;
  const std::uint64_t total = s.store->size(), piece = round_up(kPiece, m.block_elems);
  std::size_t k = 0;
  try {
    for (std::uint64_t p = 0; p < total; p += piece)
      restore_piece(s, {p, std::min(piece, total - p)}, segs, &k, *shards);
  } catch (...) {
    s.bytes_read = shards->bytes_read();
    s.bytes_restored = s.bytes_read - s.bytes_verified;
    throw;
  }
  s.bytes_read = shards->bytes_read();
  s.bytes_restored = s.bytes_read - s.bytes_verified;
  copy_counters(m, s);
  for (std::size_t i = 0; i < s.tensor_steps.size(); ++i)
    s.tensor_steps[i] = m.tensor_steps[saved[i]];
  std::uint64_t shard_bytes = 0;
  for (const auto& e : m.shards) shard_bytes += e.bytes;
  const std::string done =
      strcat("checkpoint: rank ", s.rank, " loaded serial ", m.serial, " (saved by ", m.world,
             " ranks at stage ", m.stage, ") from ", dir.path(), ": read ", s.bytes_read,
             " bytes (", s.bytes_verified, " verified before any change + ", s.bytes_restored,
             " restored) of shards totalling ", shard_bytes, " bytes");
  if (s.rank == 0)
    log_info(done);
  else
    log_debug(done);
}

}  // namespace strata::checkpoint
