#include "io/engine_base.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/rethrow.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::io {

namespace {
Mutex g_hook_mu;
RawResultHook g_hook GUARDED_BY(g_hook_mu);
std::atomic<bool> g_hook_set{false};

std::chrono::steady_clock::time_point deadline_after(std::chrono::nanoseconds timeout) {
  constexpr std::chrono::nanoseconds kMax{1'000'000'000'000'000'000LL};  // ~31 years
  if (timeout < std::chrono::nanoseconds::zero()) timeout = std::chrono::nanoseconds::zero();
  if (timeout > kMax) timeout = kMax;
  return std::chrono::steady_clock::now() + timeout;
}
}  // namespace

void set_raw_result_hook(RawResultHook hook) {
  MutexLock lock(g_hook_mu);
  g_hook = std::move(hook);
  g_hook_set.store(static_cast<bool>(g_hook));
}

bool raw_result_hook_set() { return g_hook_set.load(std::memory_order_relaxed); }

long apply_raw_result_hook(const Piece& piece, long result) {
  if (!raw_result_hook_set()) return result;
  RawResultHook hook;
  {
    MutexLock lock(g_hook_mu);
    hook = g_hook;
  }
  return hook ? hook(piece, result) : result;
}

bool io_uring_fail_simulated() {
  const char* v = std::getenv("STRATA_IO_URING_FAIL");
  return v && *v && std::strcmp(v, "0") != 0;
}

EngineBase::EngineBase(const IoEngineOptions& options) : options_(options) { options_.validate(); }

EngineBase::~EngineBase() = default;

FileId EngineBase::register_file(std::shared_ptr<IoFile> file) {
  if (!file || file->fd() < 0)
    fail(ErrorCode::kInvalidArgument, "io: register_file: file is not open");
  std::vector<std::shared_ptr<IoFile>> files;
  files.push_back(std::move(file));
  return add_entry(std::move(files));
}

FileId EngineBase::register_striped(std::vector<std::shared_ptr<IoFile>> files) {
  if (files.empty()) fail(ErrorCode::kInvalidArgument, "io: register_striped: no files");
  for (auto& f : files)
    if (!f || f->fd() < 0)
      fail(ErrorCode::kInvalidArgument, "io: register_striped: a file is not open");
  bool direct = files.front()->direct();
  for (auto& f : files)
    if (f->direct() != direct)
      fail(ErrorCode::kInvalidArgument,
           strcat("io: register_striped: ", f->path(), " is ", f->direct() ? "" : "not ",
                  "O_DIRECT but ", files.front()->path(), " is ", direct ? "" : "not"));
  return add_entry(std::move(files));
}

FileId EngineBase::add_entry(std::vector<std::shared_ptr<IoFile>> files) {
  auto entry = std::make_shared<FileEntry>();
  for (auto& f : files) {
    entry->alignment = std::max(entry->alignment, f->alignment());
    entry->read_only = entry->read_only || f->read_only();
  }
  if (files.size() > 1 && options_.block_size % entry->alignment != 0)
    fail(ErrorCode::kInvalidArgument,
         strcat("io: block_size ", options_.block_size, " is not a multiple of the alignment ",
                entry->alignment, " of the striped files"));
  MutexLock lock(files_mu_);
  entry->files = std::move(files);
  for (auto& f : entry->files) {
    int slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
    } else {
      slot = next_slot_++;
    }
    int got = on_file_registered(slot, f->fd());
    if (got < 0) free_slots_.push_back(slot);
    entry->fixed_slots.push_back(got);
  }
  FileId id = next_file_++;
  files_.emplace(id, std::move(entry));
  return id;
}

void EngineBase::unregister_file(FileId id) {
  MutexLock lock(files_mu_);
  auto it = files_.find(id);
  if (it == files_.end()) fail(ErrorCode::kInvalidArgument, strcat("io: unknown file id ", id));
  if (it->second->in_flight.load() != 0)
    fail(ErrorCode::kInvalidArgument,
         strcat("io: unregister_file: ", it->second->in_flight.load(), " request(s) in flight on ",
                it->second->files.front()->path()));
  for (int slot : it->second->fixed_slots) {
    if (slot >= 0) {
      on_file_unregistered(slot);
      free_slots_.push_back(slot);
    }
  }
  files_.erase(it);
}

std::uint32_t EngineBase::alignment(FileId id) const {
  MutexLock lock(files_mu_);
  auto it = files_.find(id);
  if (it == files_.end()) fail(ErrorCode::kInvalidArgument, strcat("io: unknown file id ", id));
  return it->second->alignment;
}

std::string EngineBase::describe_file(FileId id) const {
  MutexLock lock(files_mu_);
  auto it = files_.find(id);
  if (it == files_.end()) return strcat("<file ", id, ">");
  std::string s;
  for (auto& f : it->second->files) {
    if (!s.empty()) s += "|";
    s += f->path();
  }
  return s;
}

void EngineBase::register_buffers(std::span<const IoRegion> regions) {
  for (auto& r : regions)
    if (!r.base || r.length == 0)
      fail(ErrorCode::kInvalidArgument, "io: register_buffers: empty or null region");
  bool ok = regions.empty() ? false : on_buffers_registered(regions);
  auto table = std::make_shared<std::vector<Region>>();
  if (ok) {
    for (std::size_t i = 0; i < regions.size(); ++i) {
      auto* b = static_cast<std::uint8_t*>(regions[i].base);
      table->push_back({b, b + regions[i].length, static_cast<int>(i)});
    }
    std::sort(table->begin(), table->end(),
              [](const Region& a, const Region& b) { return a.begin < b.begin; });
  }
  MutexLock lock(files_mu_);
  regions_ = std::move(table);
}

IoTicket EngineBase::submit(const IoRequest& request) {
  return submit_batch(std::span<const IoRequest>(&request, 1));
}

// The registered region [buffer, buffer + len) lies in (its index for fixed I/O), or -1.
int EngineBase::region_index(const std::vector<Region>* regions, std::uint8_t* buffer,
                             std::uint64_t len) {
  if (!regions || regions->empty()) return -1;
  auto it = std::upper_bound(regions->begin(), regions->end(), buffer,
                             [](std::uint8_t* b, const Region& reg) { return b < reg.begin; });
  if (it == regions->begin()) return -1;
  --it;
  return buffer >= it->begin && buffer + len <= it->end ? it->index : -1;
}

// Every request's file entry (throws for an unknown file id), and the registered regions.
std::vector<std::shared_ptr<EngineBase::FileEntry>> EngineBase::entries_of(
    std::span<const IoRequest> requests, std::shared_ptr<const std::vector<Region>>& regions) {
  std::vector<std::shared_ptr<FileEntry>> entries(requests.size());
  MutexLock lock(files_mu_);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    auto it = files_.find(requests[i].file);
    if (it == files_.end())
      fail(ErrorCode::kInvalidArgument, strcat("io: request ", i, " of ", requests.size(),
                                               ": unknown file id ", requests[i].file));
    entries[i] = it->second;
  }
  regions = regions_;
  return entries;
}

// Validates every request before anything is submitted.
void EngineBase::validate(std::span<const IoRequest> requests,
                          const std::vector<std::shared_ptr<FileEntry>>& entries) {
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const IoRequest& r = requests[i];
    const FileEntry& e = *entries[i];
    auto where = [&] {
      return strcat("io: ", io_op_name(r.op), " ", e.files.front()->path(),
                    e.files.size() > 1 ? " (striped)" : "", " offset=", r.offset,
                    " length=", r.length, " buffer=", r.buffer, ": ");
    };
    if (r.length == 0) fail(ErrorCode::kInvalidArgument, where() + "zero length");
    if (!r.buffer) fail(ErrorCode::kInvalidArgument, where() + "null buffer");
    if (r.op == IoOp::kWrite && e.read_only)
      fail(ErrorCode::kInvalidArgument, where() + "file is open read-only");
    if (r.offset + r.length < r.offset)
      fail(ErrorCode::kInvalidArgument, where() + "range overflows");
    std::uint64_t a = e.alignment;
    if (a > 1) {
      const char* what = nullptr;
      if (reinterpret_cast<std::uintptr_t>(r.buffer) % a)
        what = "buffer address";
      else if (r.offset % a)
        what = "offset";
      else if (r.length % a)
        what = "length";
      if (what)
        fail(ErrorCode::kInvalidArgument,
             where() + strcat(what, " is not a multiple of the O_DIRECT alignment ", a));
    }
  }
}

// Splits the requests into pieces at block_size boundaries of the logical space (striped files:
// block by block over the stripe).
std::vector<Piece> EngineBase::split(Op* op, std::span<const IoRequest> requests,
                                     const std::vector<std::shared_ptr<FileEntry>>& entries,
                                     const std::vector<Region>* regions) const {
  const std::uint64_t bs = options_.block_size;
  std::vector<Piece> pieces;
  std::size_t estimate = 0;
  for (auto& r : requests) estimate += (r.length + bs - 1) / bs + 1;
  pieces.reserve(estimate);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const IoRequest& r = requests[i];
    const FileEntry& e = *entries[i];
    const std::uint64_t n = e.files.size();
    std::uint64_t pos = r.offset, end = r.offset + r.length;
    auto* buf = static_cast<std::uint8_t*>(r.buffer);
    while (pos < end) {
      std::uint64_t block = pos / bs;
      std::uint64_t within = pos % bs;
      std::uint64_t len = std::min(bs - within, end - pos);
      Piece p;
      p.op = op;
      p.request_index = static_cast<std::uint32_t>(i);
      p.kind = r.op;
      std::uint64_t fi = n == 1 ? 0 : block % n;
      p.file = e.files[fi].get();
      p.fixed_file = e.fixed_slots[fi];
      p.buffer = buf + (pos - r.offset);
      p.length = len;
      p.offset = n == 1 ? pos : (block / n) * bs + within;
      p.buf_index = region_index(regions, p.buffer, len);
      pieces.push_back(p);
      pos += len;
    }
  }
  return pieces;
}

IoTicket EngineBase::submit_batch(std::span<const IoRequest> requests) {
  if (!accepting()) fail(ErrorCode::kCancelled, strcat("io: ", name(), " engine is shut down"));
  if (requests.empty()) fail(ErrorCode::kInvalidArgument, "io: submit_batch: empty batch");

  auto op = std::make_shared<Op>();
  op->requests = static_cast<std::uint32_t>(requests.size());
  op->kind = requests.front().op;
  std::shared_ptr<const std::vector<Region>> regions;
  const auto entries = entries_of(requests, regions);
  validate(requests, entries);
  std::vector<Piece> pieces = split(op.get(), requests, entries, regions.get());
  op->remaining.store(static_cast<std::uint32_t>(pieces.size()));
  for (auto& e : entries) {
    e->in_flight.fetch_add(1);
    op->in_flight.push_back(&e->in_flight);
    op->files.push_back(e);
  }
  std::uint64_t fixed = 0;
  for (auto& p : pieces) fixed += p.buf_index >= 0;
  pieces_.fetch_add(pieces.size(), std::memory_order_relaxed);
  fixed_pieces_.fetch_add(fixed, std::memory_order_relaxed);
  {
    MutexLock lock(mu_);
    op->id = next_ticket_++;
    ops_.emplace(op->id, op);
  }
  IoTicket id = op->id;
  dispatch(pieces);
  return id;
}

void EngineBase::complete_piece(Piece& piece, std::exception_ptr error) {
  Op* op = piece.op;
  if (error) {
    // The worker must hold no reference to the error once the op can complete: the waiter may
    // then drop the last one (libstdc++'s exception refcount is invisible to TSan).
    std::exception_ptr unused;
    MutexLock lock(op->error_mu);
    if (!op->error || piece.request_index < op->error_index) {
      op->error = std::move(error);
      op->error_index = piece.request_index;
    } else {
      unused = std::move(error);
    }
  } else {
    op->bytes.fetch_add(piece.length, std::memory_order_relaxed);
    (piece.kind == IoOp::kRead ? bytes_read_ : bytes_written_)
        .fetch_add(piece.length, std::memory_order_relaxed);
  }
  if (op->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) finish_op(op);
}

void EngineBase::fail_piece(Piece& piece, int errnum, const char* context) {
  std::exception_ptr e;
  try {
    throw IoError(io_op_name(piece.kind), piece.file->path(), piece.offset, piece.length, errnum,
                  context ? context : "");
  } catch (...) {
    e = std::current_exception();
  }
  complete_piece(piece, std::move(e));
}

void EngineBase::cancel_piece(Piece& piece) {
  {
    MutexLock lock(piece.op->error_mu);
    piece.op->cancelled = true;
  }
  std::exception_ptr e;
  try {
    fail(ErrorCode::kCancelled,
         strcat("io: ", io_op_name(piece.kind), " ", piece.file->path(), " offset=", piece.offset,
                " length=", piece.length, ": cancelled by engine shutdown"));
  } catch (...) {
    e = std::current_exception();
  }
  complete_piece(piece, std::move(e));
}

void EngineBase::finish_op(Op* op) {
  requests_.fetch_add(op->requests, std::memory_order_relaxed);
  {
    MutexLock lock(op->error_mu);
    if (op->error) failures_.fetch_add(1, std::memory_order_relaxed);
  }
  for (auto* c : op->in_flight) c->fetch_sub(1);
  bool wake;
  {
    MutexLock lock(mu_);
    op->done = true;
    wake = waiters_ > 0;
  }
  // Outside the lock, so the woken waiter does not block on mu_ at once; skipped when nobody
  // waits (a waiter registers under mu_ before it sleeps and re-checks `done` first). The engine
  // outlives every ring/worker thread, so cv_ is still alive here.
  if (wake) cv_.notify_all();
}

// Waits (mu_ held through `lock`) until `ticket` is done or the deadline passes, and retires it.
// Returns the op, or null when it was retired already or the deadline passed (*timed_out).
std::shared_ptr<Op> EngineBase::take_done(UniqueLock& lock, IoTicket ticket,
                                          std::chrono::steady_clock::time_point deadline,
                                          bool* timed_out) {
  *timed_out = false;
  auto it = ops_.find(ticket);
  if (it == ops_.end()) {
    if (ticket == 0 || ticket >= next_ticket_)
      fail(ErrorCode::kInvalidArgument, strcat("io: unknown ticket ", ticket));
    return nullptr;  // already retired
  }
  std::shared_ptr<Op> op = it->second;
  if (!op->done) {
    ++waiters_;
    bool done = cv_.wait_until(lock, deadline, [&] { return op->done; });
    --waiters_;
    if (!done) {
      *timed_out = true;
      return nullptr;
    }
  }
  ops_.erase(ticket);
  return op;
}

bool EngineBase::retire(IoTicket ticket, std::chrono::steady_clock::time_point deadline) {
  std::shared_ptr<Op> op;
  bool timed_out = false;
  {
    UniqueLock lock(mu_);
    op = take_done(lock, ticket, deadline, &timed_out);
  }
  if (timed_out) return false;
  if (!op) return true;
  std::exception_ptr e;
  {
    MutexLock elock(op->error_mu);
    e = op->error;
  }
  if (e) rethrow_detached(e);
  return true;
}

bool EngineBase::wait(IoTicket ticket, std::chrono::nanoseconds timeout) {
  return retire(ticket, deadline_after(timeout));
}

bool EngineBase::poll(IoTicket ticket) { return retire(ticket, std::chrono::steady_clock::now()); }

bool EngineBase::wait_all(std::chrono::nanoseconds timeout) {
  auto deadline = deadline_after(timeout);
  UniqueLock lock(mu_);
  const IoTicket last = next_ticket_ - 1;
  auto all_done = [&]() REQUIRES(mu_) {
    for (auto& [id, op] : ops_)
      if (id <= last && !op->done) return false;
    return true;
  };
  ++waiters_;
  bool finished = cv_.wait_until(lock, deadline, all_done);
  --waiters_;
  if (!finished) return false;
  std::vector<std::shared_ptr<Op>> done;
  for (auto it = ops_.begin(); it != ops_.end();) {
    if (it->first <= last) {
      done.push_back(it->second);
      it = ops_.erase(it);
    } else {
      ++it;
    }
  }
  lock.unlock();
  std::sort(done.begin(), done.end(), [](auto& a, auto& b) { return a->id < b->id; });
  for (auto& op : done) {
    MutexLock elock(op->error_mu);
    if (op->error) rethrow_detached(op->error);
  }
  return true;
}

IoStats EngineBase::stats() const {
  IoStats s;
  s.bytes_read = bytes_read_.load();
  s.bytes_written = bytes_written_.load();
  s.requests = requests_.load();
  s.pieces = pieces_.load();
  s.retries = retries_.load();
  s.failures = failures_.load();
  s.fixed_pieces = fixed_pieces_.load();
  return s;
}

}  // namespace strata::io
