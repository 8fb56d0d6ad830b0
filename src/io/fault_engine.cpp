#include <algorithm>
#include <random>
#include <thread>

#include "core/rethrow.hpp"
#include "strata/error.hpp"
#include "strata/io_fault.hpp"

namespace strata {

namespace {
std::chrono::steady_clock::time_point deadline_after(std::chrono::nanoseconds timeout) {
  constexpr std::chrono::nanoseconds kMax{1'000'000'000'000'000'000LL};
  if (timeout < std::chrono::nanoseconds::zero()) timeout = std::chrono::nanoseconds::zero();
  if (timeout > kMax) timeout = kMax;
  return std::chrono::steady_clock::now() + timeout;
}

std::unique_ptr<IoEngine> non_null(std::unique_ptr<IoEngine> inner) {
  if (!inner) fail(ErrorCode::kInvalidArgument, "FaultInjectingIoEngine: null inner engine");
  return inner;
}

std::exception_ptr make_io_error(IoOp op, const std::string& path, std::uint64_t offset,
                                 std::uint64_t length, int errnum, const std::string& context) {
  try {
    throw IoError(io_op_name(op), path, offset, length, errnum, context);
  } catch (...) {
    return std::current_exception();
  }
}
}  // namespace

IoFault IoFault::fail_nth(std::uint64_t nth, int errnum, std::optional<IoOp> op) {
  return {.kind = IoFaultKind::kError, .op = op, .nth = nth, .errnum = errnum};
}

IoFault IoFault::short_nth(std::uint64_t nth, std::uint64_t bytes, std::optional<IoOp> op) {
  return {.kind = IoFaultKind::kShortResult, .op = op, .nth = nth, .short_bytes = bytes};
}

IoFault IoFault::delay_nth(std::uint64_t nth, std::chrono::milliseconds delay,
                           std::optional<IoOp> op) {
  return {.kind = IoFaultKind::kDelay, .op = op, .nth = nth, .delay = delay};
}

IoFault IoFault::corrupt_nth_read(std::uint64_t nth, std::uint64_t bit) {
  return {.kind = IoFaultKind::kCorruptRead, .op = IoOp::kRead, .nth = nth, .bit = bit};
}

struct FaultInjectingIoEngine::Pending {
  std::mutex mu;
  IoTicket inner = 0;  // 0 = nothing passed to the inner engine
  bool inner_done = false;
  std::exception_ptr inner_error;
  std::exception_ptr injected;  // lowest-index injected failure
  std::uint32_t injected_index = ~0u;
  std::chrono::milliseconds delay{0};
  std::chrono::steady_clock::time_point ready_at{};
  struct Flip {
    std::uint8_t* buffer;
    std::uint64_t bit;
  };
  std::vector<Flip> flips;
};

FaultInjectingIoEngine::FaultInjectingIoEngine(std::unique_ptr<IoEngine> inner)
    : IoEngineWrapper(non_null(std::move(inner))) {
  name_ = strcat("fault(", this->inner().name(), ")");
}

FaultInjectingIoEngine::~FaultInjectingIoEngine() { inner().shutdown(); }

const char* FaultInjectingIoEngine::name() const { return name_.c_str(); }

std::size_t FaultInjectingIoEngine::add_fault(const IoFault& fault) {
  if (fault.nth == 0) fail(ErrorCode::kInvalidArgument, "IoFault: nth is 1-based");
  std::lock_guard<std::mutex> lock(mu_);
  FaultState s;
  s.fault = fault;
  if (fault.kind == IoFaultKind::kCorruptRead) s.fault.op = IoOp::kRead;
  faults_.push_back(s);
  return faults_.size() - 1;
}

void FaultInjectingIoEngine::clear_faults() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& f : faults_) f.fault.count = 1, f.fault.nth = ~0ULL;  // keep ids valid, never fire
}

std::uint64_t FaultInjectingIoEngine::fired(std::size_t fault_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (fault_id >= faults_.size()) fail(ErrorCode::kInvalidArgument, "unknown fault id");
  return faults_[fault_id].fired;
}

std::uint64_t FaultInjectingIoEngine::fired_total() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::uint64_t n = 0;
  for (auto& f : faults_) n += f.fired;
  return n;
}

IoTicket FaultInjectingIoEngine::submit(const IoRequest& request) {
  return submit_batch(std::span<const IoRequest>(&request, 1));
}

namespace {

// The engines' up-front validation, so that a request an error fault swallows is still rejected
// when it is invalid. Returns each request's file alignment.
std::vector<std::uint32_t> check_batch(const IoEngine& inner, std::span<const IoRequest> requests) {
  std::vector<std::uint32_t> align(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const IoRequest& r = requests[i];
    align[i] = inner.alignment(r.file);  // throws for an unknown file
    std::uint64_t a = align[i];
    if (r.length == 0 || !r.buffer || reinterpret_cast<std::uintptr_t>(r.buffer) % a ||
        r.offset % a || r.length % a)
      fail(ErrorCode::kInvalidArgument,
           strcat("io: ", io_op_name(r.op), " ", inner.describe_file(r.file), " offset=", r.offset,
                  " length=", r.length, " buffer=", r.buffer,
                  ": empty, null or not a multiple of the O_DIRECT alignment ", a));
  }
  return align;
}

}  // namespace

// The faults that fire on `r` (request `index` of its batch) applied to the batch's Pending: an
// error or a short result recorded, a delay or bit flips noted; what still goes to the inner
// engine is appended to `pass`. REQUIRES: mu_ held.
void FaultInjectingIoEngine::apply_faults(const IoRequest& r, std::uint32_t align,
                                          std::size_t index, Pending& pending,
                                          std::vector<IoRequest>& pass) {
  bool error = false;
  int errnum = 0;
  std::uint64_t short_len = 0;
  bool is_short = false;
  for (auto& s : faults_) {
    const IoFault& f = s.fault;
    if (f.op && *f.op != r.op) continue;
    if (f.file && *f.file != r.file) continue;
    std::uint64_t n = ++s.matched;
    if (n < f.nth || (f.count != 0 && n >= f.nth + f.count)) continue;
    ++s.fired;
    switch (f.kind) {
      case IoFaultKind::kError:
        if (!error) {
          error = true;
          errnum = f.errnum;
        }
        break;
      case IoFaultKind::kShortResult: {
        std::uint64_t want = f.short_bytes ? f.short_bytes : r.length / 2;
        if (want >= r.length) want = r.length - 1;
        want -= want % align;
        if (!is_short || want < short_len) short_len = want;
        is_short = true;
        break;
      }
      case IoFaultKind::kDelay: pending.delay = std::max(pending.delay, f.delay); break;
      case IoFaultKind::kCorruptRead: {
        std::uint64_t bit = f.bit;
        if (bit == IoFault::kRandomBit) {
          std::mt19937_64 rng(f.seed + n);
          bit = rng() % (r.length * 8);
        }
        if (bit < r.length * 8)
          pending.flips.push_back({static_cast<std::uint8_t*>(r.buffer), bit});
        break;
      }
    }
  }
  auto record = [&](std::exception_ptr e) {
    if (index < pending.injected_index) {
      pending.injected = e;
      pending.injected_index = static_cast<std::uint32_t>(index);
    }
  };
  const std::string path = inner().describe_file(r.file);
  if (error) {
    record(make_io_error(r.op, path, r.offset, r.length, errnum, "injected fault"));
    return;
  }
  if (is_short) {
    record(make_io_error(r.op, path, r.offset, r.length, 0,
                         strcat(r.op == IoOp::kRead ? "short read: " : "short write: ", short_len,
                                " of ", r.length, " bytes (injected)")));
    if (short_len == 0) return;
    IoRequest cut = r;
    cut.length = short_len;
    pass.push_back(cut);
    return;
  }
  pass.push_back(r);
}

IoTicket FaultInjectingIoEngine::submit_batch(std::span<const IoRequest> requests) {
  if (requests.empty()) fail(ErrorCode::kInvalidArgument, "io: submit_batch: empty batch");
  const std::vector<std::uint32_t> align = check_batch(inner(), requests);
  auto pending = std::make_shared<Pending>();
  std::vector<IoRequest> pass;
  pass.reserve(requests.size());
  IoTicket id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (std::size_t i = 0; i < requests.size(); ++i)
      apply_faults(requests[i], align[i], i, *pending, pass);
    id = next_ticket_++;
  }
  if (!pass.empty()) pending->inner = inner().submit_batch(pass);
  std::lock_guard<std::mutex> lock(mu_);
  pending_.emplace(id, pending);
  return id;
}

bool FaultInjectingIoEngine::finish(IoTicket ticket,
                                    std::chrono::steady_clock::time_point deadline) {
  std::shared_ptr<Pending> p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(ticket);
    if (it == pending_.end()) {
      if (ticket == 0 || ticket >= next_ticket_)
        fail(ErrorCode::kInvalidArgument, strcat("io: unknown ticket ", ticket));
      return true;  // retired (or being submitted by another thread: see contract)
    }
    p = it->second;
  }
  std::unique_lock<std::mutex> plock(p->mu);
  if (!p->inner_done) {
    if (p->inner) {
      try {
        auto now = std::chrono::steady_clock::now();
        auto left = deadline > now ? deadline - now : std::chrono::steady_clock::duration::zero();
        if (!inner().wait(p->inner, left)) return false;
      } catch (...) {
        p->inner_error = std::current_exception();
      }
    }
    p->inner_done = true;
    if (!p->inner_error)
      for (auto& f : p->flips) f.buffer[f.bit / 8] ^= static_cast<std::uint8_t>(1u << (f.bit % 8));
    p->ready_at = std::chrono::steady_clock::now() + p->delay;
  }
  if (p->delay.count() > 0) {
    auto now = std::chrono::steady_clock::now();
    if (now < p->ready_at) {
      if (deadline < p->ready_at) {
        if (deadline > now) std::this_thread::sleep_until(deadline);
        return false;
      }
      std::this_thread::sleep_until(p->ready_at);
    }
  }
  plock.unlock();
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.erase(ticket);
  }
  if (p->injected) rethrow_detached(p->injected);
  if (p->inner_error) rethrow_detached(p->inner_error);
  return true;
}

bool FaultInjectingIoEngine::wait(IoTicket ticket, std::chrono::nanoseconds timeout) {
  return finish(ticket, deadline_after(timeout));
}

bool FaultInjectingIoEngine::poll(IoTicket ticket) {
  return finish(ticket, std::chrono::steady_clock::now());
}

bool FaultInjectingIoEngine::wait_all(std::chrono::nanoseconds timeout) {
  auto deadline = deadline_after(timeout);
  std::vector<IoTicket> tickets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, p] : pending_) tickets.push_back(id);
  }
  std::sort(tickets.begin(), tickets.end());
  std::exception_ptr first;
  bool all = true;
  for (IoTicket t : tickets) {
    try {
      if (!finish(t, deadline)) all = false;
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (!all) return false;
  if (first) rethrow_detached(first);
  return true;
}

}  // namespace strata
