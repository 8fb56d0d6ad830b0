// Per-request submission/completion overhead of the I/O engines: 4 KiB buffered reads of a file
// in the page cache (so the device does not dominate), one request at a time (submit + wait) and
// in batches of 32. Reference in the same run: a plain pread() of the same 4 KiB (BM_Pread).
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <vector>

#include "strata/io_engine.hpp"

namespace {

using namespace std::chrono_literals;
constexpr std::size_t kReq = 4096;
constexpr std::size_t kFile = 1 << 20;

struct Fixture {
  std::string path;
  std::shared_ptr<strata::IoFile> file;
  std::unique_ptr<strata::IoEngine> engine;
  strata::FileId id = 0;
  strata::IoBuffer buf;

  Fixture(strata::IoEngineKind kind, std::uint32_t qd) {
    path =
        (std::filesystem::temp_directory_path() / ("strata-bench-io-" + std::to_string(::getpid())))
            .string();
    file = std::make_shared<strata::IoFile>(
        strata::IoFile::open(path, {.create = true, .direct_io = strata::DirectIoMode::kOff}));
    std::vector<char> data(kFile, 'x');
    if (::pwrite(file->fd(), data.data(), data.size(), 0) != static_cast<ssize_t>(data.size()))
      throw std::runtime_error("pwrite failed");
    strata::IoEngineOptions o;
    o.kind = kind;
    o.queue_depth = qd;
    o.direct_io = strata::DirectIoMode::kOff;
    engine = kind == strata::IoEngineKind::kIoUring ? strata::make_io_uring_engine(o)
                                                    : strata::make_thread_io_engine(o);
    id = engine->register_file(file);
    buf = strata::IoBuffer::allocate(kReq * 64);
  }
  ~Fixture() {
    engine.reset();
    std::filesystem::remove(path);
  }
};

void BM_Pread(benchmark::State& state) {
  Fixture f(strata::IoEngineKind::kThreads, 1);
  std::size_t i = 0;
  for (auto _ : state) {
    ssize_t n = ::pread(f.file->fd(), f.buf.data(), kReq, (i++ % (kFile / kReq)) * kReq);
    benchmark::DoNotOptimize(n);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_SubmitWait(benchmark::State& state) {
  auto kind = static_cast<strata::IoEngineKind>(state.range(0));
  Fixture f(kind, 1);
  std::size_t i = 0;
  for (auto _ : state) {
    auto t = f.engine->submit(
        {strata::IoOp::kRead, f.id, f.buf.data(), kReq, (i++ % (kFile / kReq)) * kReq});
    f.engine->wait_for(t, 10s);
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(f.engine->name());
}

void BM_SubmitBatch32(benchmark::State& state) {
  auto kind = static_cast<strata::IoEngineKind>(state.range(0));
  Fixture f(kind, 32);
  std::vector<strata::IoRequest> reqs(32);
  for (std::size_t j = 0; j < reqs.size(); ++j)
    reqs[j] = {strata::IoOp::kRead, f.id, f.buf.bytes() + j * kReq, kReq, j * kReq};
  for (auto _ : state) {
    auto t = f.engine->submit_batch(reqs);
    f.engine->wait_for(t, 10s);
  }
  state.SetItemsProcessed(state.iterations() * 32);
  state.SetLabel(f.engine->name());
}

constexpr int kUring = static_cast<int>(strata::IoEngineKind::kIoUring);
constexpr int kThreads = static_cast<int>(strata::IoEngineKind::kThreads);

BENCHMARK(BM_Pread)->UseRealTime();
BENCHMARK(BM_SubmitWait)->Arg(kUring)->Arg(kThreads)->UseRealTime();
BENCHMARK(BM_SubmitBatch32)->Arg(kUring)->Arg(kThreads)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
