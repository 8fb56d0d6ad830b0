// `strata train CONFIG [--steps N] [--ranks N] [--checkpoint-dir DIR [--save-every N] [--resume]]
// [--json]`: the example training loop. Trains a two-layer MLP on synthetic regression through the
// ZeRO Engine (zero.stage, precision.*, optimizer.* from the config) on in-process ranks (threads;
// --ranks, else world.ranks), or one rank per process under mpirun — with runtime.communicator
// nccl one GPU per rank, the collectives on NCCL and the engine's state in device memory where
// offload.* says gpu (the MLP itself runs on the host) — printing the loss, the step
// time and samples/s per step. With --checkpoint-dir it saves a checkpoint every --save-every steps
// and after the last; --resume continues from the checkpoint in DIR (if there is one) at the step
// it was saved after, with any world size or stage: the batches are a function of (rank, step), so
// a run killed and resumed gives the losses of a run that never stopped (same options, same world).
// The model and data options (--hidden, --batch, --seed) go into DIR/train.json beside each
// checkpoint, and --resume refuses other values (see check_resume_options).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "checkpoint/format.hpp"
#include "cli/command.hpp"
#include "cli/mlp_model.hpp"
#include "comm/numeric.hpp"
#include "core/bounded_json.hpp"
#include "core/file_env.hpp"
#include "core/printable.hpp"
#include "core/safe_fs.hpp"
#include "strata/communicator.hpp"
#include "strata/config.hpp"
#include "strata/device.hpp"
#include "strata/device_query.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace cmd_train {
namespace {

using namespace strata;

struct Options : strata::cli::ConfigArgs {
  int steps = 50;
  int ranks = 0;  // 0 (not given): world.ranks in-process ranks, or the MPI world under mpirun
  int batch = 32;
  int accumulate = 1;             // micro-batches per step, batch / accumulate samples each
  bool accumulate_given = false;  // --accumulate given (else train.accumulate)
  int hidden = 64;
  std::int64_t seed = 1;
  std::string checkpoint_dir;
  int save_every = 0;           // 0: only after the last step
  bool blocking_saves = false;  // --save-every saves wait for their writes (else asynchronous)
  bool resume = false;
  bool json = false;
};

struct StepRecord {
  int step;
  double loss;
  double grad_norm;
  double loss_scale;
  bool applied;
  double seconds;             // the step's wall time on rank 0 (forward, backward, step(), loss)
  double samples_per_second;  // batch x ranks / seconds
};

struct SaveRecord {
  int step;
  double seconds;  // training blocked by the save call (async: the snapshot, and the commit of
                   // the previous save when its writer was still at work)
  bool async;
};

struct RankOutcome {
  std::vector<StepRecord> steps;
  std::vector<SaveRecord> saves;
  int resumed_from = -1;  // the step the checkpoint was saved after; -1: not resumed
  EngineStats stats;
  std::size_t flat_size = 0;
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// DIR/train.json: the options that decide the model's shapes and the batches (a function of seed,
// rank and step), with the serial of the checkpoint they belong to. Written by rank 0 after each
// save (tmp + rename); a crash between the two leaves the previous save's file, whose serial then
// does not match and is not used.
constexpr const char* kTrainOptionsFile = "train.json";
constexpr std::size_t kTrainOptionsMaxBytes = 64 * 1024;

void write_train_options(const Options& o) {
  const SafeDir dir = SafeDir::open(o.checkpoint_dir, {});
  const checkpoint::Manifest m = checkpoint::read_manifest(dir);
  const std::string text = nlohmann::json{{"hidden", o.hidden},
                                          {"batch", o.batch},
                                          {"accumulate", o.accumulate},
                                          {"seed", o.seed},
                                          {"checkpoint_serial", m.serial},
                                          {"step", m.steps}}
                               .dump(2) +
                           "\n";
  // Through the checkpoint's file seam, as the checkpoint itself.
  write_file_atomically(FileEnv::current(), dir, kTrainOptionsFile,
                        std::string(kTrainOptionsFile) + ".tmp", text, 0644);
}

// Rank 0: writes train.json whenever the committed manifest changed since it last did (a save
// committed by its call, or an asynchronous one committed by a later step once every rank's shard
// was durable, or by the next save). One stat per call; the manifest is read only when it changed.
class TrainOptionsWriter {
 public:
  void after_commit_point(const Options& o) {
    struct stat st {};
    const std::string path = (std::filesystem::path(o.checkpoint_dir) / "manifest.json").string();
    if (::stat(path.c_str(), &st) != 0) return;  // nothing committed yet
    if (st.st_ino == ino_ && st.st_dev == dev_) return;
    write_train_options(o);
    ino_ = st.st_ino;
    dev_ = st.st_dev;
  }

 private:
  ino_t ino_ = 0;
  dev_t dev_ = 0;
};

// --resume with a checkpoint in DIR: refuses --hidden/--batch/--seed other than those it was
// trained with (the run would continue on other batches, or fail to load other shapes). A
// missing train.json (a checkpoint not written by strata train, or by an older one) or one from
// another save is warned about and not checked. REQUIRES: DIR holds manifest.json.
void check_resume_options(const Options& o) {
  const SafeDir dir = SafeDir::open(o.checkpoint_dir, {});
  const checkpoint::Manifest m = checkpoint::read_manifest(dir);
  const std::string path = dir.child_path(kTrainOptionsFile);
  // Opened, then checked on the descriptor (as read_manifest does): not a FIFO, not huge.
  std::unique_ptr<RandomAccessFile> file;
  try {
    file = FileEnv::current().open_file(dir, kTrainOptionsFile);
  } catch (const IoError& e) {
    if (e.errnum() != ENOENT) throw;
    log_warn("train: ", path,
             " is missing: the checkpoint's --hidden, --batch and --seed are not known; "
             "resuming with --hidden ",
             o.hidden, " --batch ", o.batch, " --seed ", o.seed, " unchecked");
    return;
  }
  const struct stat st = file->status();
  if (!S_ISREG(st.st_mode) || static_cast<std::size_t>(st.st_size) > kTrainOptionsMaxBytes)
    fail(ErrorCode::kInvalidArgument,
         strcat("--resume: ", path, " is not a regular file of at most ", kTrainOptionsMaxBytes,
                " bytes; remove it to resume unchecked"));
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  file->read_at(text.data(), text.size(), 0);
  int hidden = 0, batch = 0, accumulate = 1;
  std::int64_t seed = 0;
  std::uint64_t serial = 0;
  try {
    JsonLimits limits;  // what strata train writes: one object of five numbers
    limits.max_bytes = kTrainOptionsMaxBytes;
    limits.max_depth = 4;
    limits.max_values = 256;
    const nlohmann::json j = parse_bounded_json(text, path, limits);
    hidden = j.at("hidden").get<int>();
    batch = j.at("batch").get<int>();
    accumulate = j.value("accumulate", 1);  // absent: written before --accumulate existed
    seed = j.at("seed").get<std::int64_t>();
    serial = j.at("checkpoint_serial").get<std::uint64_t>();
  } catch (const std::exception& e) {
    fail(ErrorCode::kInvalidArgument,
         strcat("--resume: ", path, " is not what strata train writes (", e.what(),
                "); remove it to resume unchecked"));
  }
  if (serial != m.serial) {
    log_warn("train: ", path, " belongs to another save (serial ", serial, ", the checkpoint's is ",
             m.serial, "): resuming with --hidden ", o.hidden, " --batch ", o.batch, " --seed ",
             o.seed, " unchecked");
    return;
  }
  std::string differ;
  if (hidden != o.hidden) differ += strcat(" --hidden ", o.hidden);
  if (batch != o.batch) differ += strcat(" --batch ", o.batch);
  if (accumulate != o.accumulate) differ += strcat(" --accumulate ", o.accumulate);
  if (seed != o.seed) differ += strcat(" --seed ", o.seed);
  if (!differ.empty())
    fail(ErrorCode::kInvalidArgument,
         strcat("--resume: the checkpoint in ", o.checkpoint_dir, " (after step ", m.steps,
                ") was trained with --hidden ", hidden, " --batch ", batch, " --seed ", seed,
                ", this run has", differ,
                ": a resumed run continues only with the same model and data "
                "options (the batches are a function of seed, rank and step); pass those, or train "
                "from "
                "scratch in another --checkpoint-dir"));
}

// --resume: loads the checkpoint when there is one. Returns the index of the first step to run.
int resume_if_asked(Engine& engine, const Communicator& comm, const Options& o, bool print,
                    RankOutcome& out) {
  int first = 0;
  if (o.resume &&
      std::filesystem::exists(std::filesystem::path(o.checkpoint_dir) / "manifest.json")) {
    engine.load_checkpoint(o.checkpoint_dir);
    first = static_cast<int>(
        std::min<std::uint64_t>(engine.stats().steps, static_cast<std::uint64_t>(o.steps)));
    out.resumed_from = static_cast<int>(engine.stats().steps);
    if (print)
      std::cout << "resumed from the checkpoint in " << o.checkpoint_dir << " after step "
                << out.resumed_from << std::endl;
  } else if (o.resume && comm.rank() == 0) {
    log_info("train: no checkpoint in ", o.checkpoint_dir, " yet; starting at step 1");
  }
  return first;
}

// The sum of every rank's loss, all-reduced; through device memory for a device communicator
// (NCCL), allocated once (no cudaMalloc/cudaFree beside other ranks' collectives).
class LossSum {
 public:
  LossSum(Communicator& comm, Device& device) : comm_(comm) {
    if (comm.buffer_location() == BufferLocation::kHost) return;
    buf_ = device.allocate(2 * sizeof(float));
    stream_ = device.create_stream();
  }
  float operator()(float loss) {
    float total = 0;
    if (!stream_) {
      comm_.all_reduce(&loss, &total, 1, DType::kFp32);
      return total;
    }
    auto* d = static_cast<float*>(buf_.get());
    stream_->memcpy_async(d, &loss, sizeof(float));
    stream_->synchronize(kWait);
    comm_.all_reduce(d, d + 1, 1, DType::kFp32);
    stream_->memcpy_async(&total, d + 1, sizeof(float));
    stream_->synchronize(kWait);
    return total;
  }

 private:
  static constexpr std::chrono::seconds kWait{60};
  Communicator& comm_;
  DeviceMemory buf_;
  std::unique_ptr<Stream> stream_;
};

// One micro-batch of step `s` (k of o.accumulate; batch / accumulate samples): forward, layer by
// layer — at stage 3 each layer is gathered only while it is used (and the engine prefetches the
// next layer from the second step on); no-ops at stages 0-2 — then backward, last layer first:
// the layer is gathered again (a ZeRO-3 loop does not keep it between forward and backward), its
// gradients (scaled by the loss scale and 1 / accumulate) are handed in as they are produced
// (stages 2-3 reduce-scatter full buckets at once, overlapping the rest of backward). Returns the
// micro-batch's loss.
double micro_batch(Engine& engine, cli::MlpModel& model, const std::vector<TensorId>& ids, int rank,
                   int s, int k, const Options& o) {
  model.make_batch(rank, static_cast<std::uint64_t>(s),
                   static_cast<std::size_t>(o.batch / o.accumulate), static_cast<std::uint64_t>(k));
  const std::vector<std::vector<TensorId>> layers{{ids[0], ids[1]}, {ids[2], ids[3]}};
  std::vector<std::vector<float>> params(ids.size()), grads;
  for (const auto& layer : layers) {
    engine.gather(layer);
    for (TensorId id : layer) {
      params[id].resize(engine.numel(id));
      engine.read_param(id, params[id]);
    }
    engine.release(layer);
  }
  const double loss = model.forward_backward(params, grads);
  const float scale = static_cast<float>(engine.loss_scale() / o.accumulate);
  const DType gdt = engine.grad_dtype();
  std::vector<unsigned char> gbuf;
  for (std::size_t l = layers.size(); l-- > 0;) {
    engine.gather(layers[l]);
    for (std::size_t j = layers[l].size(); j-- > 0;) {
      const TensorId id = layers[l][j];
      gbuf.resize(grads[id].size() * dtype_size(gdt));
      for (std::size_t i = 0; i < grads[id].size(); ++i)
        store_elem(gbuf.data(), i, gdt, grads[id][i] * scale);
      if (engine.device().kind() == DeviceKind::kCuda)  // computed on the host: one copy over
        engine.set_gradient_host(id, gbuf.data());
      else
        engine.set_gradient(id, gbuf.data());
    }
    engine.release(layers[l]);
  }
  return loss;
}

// One rank's training loop. Rank 0's records are the ones reported (the loss is the mean over
// all ranks' batches, exchanged through the communicator).
RankOutcome train_rank(const Config& cfg, Communicator& comm, const Options& o) {
  cli::MlpModel model({16, static_cast<std::size_t>(o.hidden), 4},
                      static_cast<std::uint64_t>(o.seed));
  Engine engine(cfg, comm);
  std::vector<TensorId> ids;
  for (std::size_t t = 0; t < cli::MlpModel::kTensors; ++t)
    ids.push_back(engine.add_parameter(model.tensor_name(t), model.initial(t)));
  engine.finalize();
  LossSum loss_sum(comm, engine.device());
  RankOutcome out;
  out.flat_size = engine.partition().flat_size();
  const bool print = comm.rank() == 0 && !o.json;
  const int first = resume_if_asked(engine, comm, o, print, out);
  TrainOptionsWriter options_writer;
  for (int s = first; s < o.steps; ++s) {
    const auto t_step = std::chrono::steady_clock::now();
    double loss = 0;
    for (int k = 0; k < o.accumulate; ++k)
      loss += micro_batch(engine, model, ids, comm.rank(), s, k, o) / o.accumulate;
    StepResult r = engine.step();
    const float total = loss_sum(static_cast<float>(loss));
    if (comm.rank() == 0) flush_rank_warnings();  // every rank is past this step's warnings
    const double secs = seconds_since(t_step);
    const double samples = static_cast<double>(o.batch) * comm.size();
    StepRecord rec{
        s + 1, total / static_cast<float>(comm.size()), r.grad_norm, r.loss_scale, r.applied,
        secs,  secs > 0 ? samples / secs : 0.0};
    out.steps.push_back(rec);
    // An asynchronous save is committed by the step after the one that found every shard durable.
    if (comm.rank() == 0 && !o.checkpoint_dir.empty() && engine.checkpoint_pending())
      options_writer.after_commit_point(o);
    if (print)
      std::cout << "step " << rec.step << "  loss " << rec.loss << "  grad_norm " << rec.grad_norm
                << "  loss_scale " << rec.loss_scale << "  time " << rec.seconds * 1e3
                << " ms  samples/s " << rec.samples_per_second
                << (rec.applied ? "" : "  (skipped: overflow)") << std::endl;
    if (!o.checkpoint_dir.empty() &&
        ((o.save_every > 0 && (s + 1) % o.save_every == 0) || s + 1 == o.steps)) {
      // Asynchronous unless asked otherwise; the last save is waited for (the run ends with it).
      const bool async = !o.blocking_saves && s + 1 < o.steps;
      const auto t_save = std::chrono::steady_clock::now();
      engine.save_checkpoint(o.checkpoint_dir, async ? SaveMode::kAsync : SaveMode::kBlocking);
      // train.json follows the committed manifest: the previous save's while this one writes.
      if (comm.rank() == 0) options_writer.after_commit_point(o);
      out.saves.push_back({s + 1, seconds_since(t_save), async});
      if (print)
        std::cout << (async ? "checkpoint after step " : "saved checkpoint after step ") << s + 1
                  << " in " << o.checkpoint_dir
                  << (async ? " writing in the background; training blocked " : " (")
                  << out.saves.back().seconds * 1e3 << " ms" << (async ? "" : ")") << std::endl;
    }
  }
  out.stats = engine.stats();
  return out;
}

// The options, checked before anything runs (an unusable --checkpoint-dir fails now, not after
// the first steps).
void check_options(const Options& o) {
  if (o.steps < 1) fail(ErrorCode::kInvalidArgument, "--steps must be >= 1");
  if (o.batch < 1 || o.hidden < 1)
    fail(ErrorCode::kInvalidArgument, "--batch and --hidden must be >= 1");
  if (o.accumulate < 1 || o.batch % o.accumulate != 0)
    fail(ErrorCode::kInvalidArgument,
         strcat(o.accumulate_given ? "--accumulate " : "train.accumulate ", o.accumulate,
                o.accumulate_given ? "" : strcat(" (", o.config, "; --accumulate overrides it)"),
                " must be >= 1 and divide --batch ", o.batch));
  if (o.seed < 0) fail(ErrorCode::kInvalidArgument, strcat("--seed ", o.seed, " must be >= 0"));
  if (o.ranks < 0) fail(ErrorCode::kInvalidArgument, strcat("--ranks ", o.ranks, " must be >= 1"));
  if (o.checkpoint_dir.empty() && (o.save_every != 0 || o.resume))
    fail(ErrorCode::kInvalidArgument, "--save-every and --resume need --checkpoint-dir");
  if (o.save_every < 0) fail(ErrorCode::kInvalidArgument, "--save-every must be >= 1");
  if (!o.checkpoint_dir.empty()) {  // an unusable directory fails now, not after the first steps
    SafeDirOptions d;
    d.create = true;
    d.role = "--checkpoint-dir";
    const SafeDir dir = SafeDir::open(o.checkpoint_dir, d);
    struct stat st {};
    if (o.resume && dir.stat_entry("manifest.json", &st)) check_resume_options(o);
  }
}

// The launch's result: rank 0's outcome, the communicator, the world.
struct Launch {
  RankOutcome outcome;
  std::string backend;
  int world = 1;
  bool report = true;  // this process reports (rank 0)
};

// Under mpirun: this process is one rank. With runtime.communicator nccl the collectives run on
// NCCL on the process's GPU (its launcher's local rank), its id exchanged over MPI.
Launch train_mpi(const Config& cfg, const Options& o, bool nccl) {
  Launch run;
  const double timeout = cfg.runtime.collective_timeout_s;
  auto comm = make_mpi_communicator(timeout);
  run.world = comm->size();
  RankLogGroup warnings(1, run.world);  // "warning (rank 3): ..."
  RankLogScope scope(warnings, comm->rank());
  if (o.ranks && o.ranks != run.world)
    fail(ErrorCode::kInvalidArgument,
         strcat("--ranks ", o.ranks, " but mpirun started ", run.world, " ranks"));
  if (!o.ranks && cfg.world.ranks != 1 && static_cast<int>(cfg.world.ranks) != run.world &&
      comm->rank() == 0)
    log_warn("train: world.ranks is ", cfg.world.ranks, " but mpirun started ", run.world,
             " ranks; using ", run.world);
  log_debug("train: MPI rank ", comm->rank(), " of ", run.world);
  run.report = comm->rank() == 0;  // rank 0 reports
  if (nccl) {
    NcclBootstrap boot;
    boot.host = comm.get();
    const int gpus = static_cast<int>(query_cuda_devices().devices.size());
    auto device_comm = make_nccl_communicator(
        boot, local_device_ordinal(comm->rank(), static_cast<int>(cfg.ranks_per_node()), gpus),
        timeout);
    run.backend = device_comm->backend_name();
    run.outcome = train_rank(cfg, *device_comm, o);
    return run;
  }
  run.backend = comm->backend_name();
  run.outcome = train_rank(cfg, *comm, o);
  return run;
}

// The in-process world: --ranks, else world.ranks; 1..256.
int inprocess_world(const Config& cfg, const Options& o) {
  const int world =
      o.ranks ? o.ranks : static_cast<int>(std::min<std::uint32_t>(cfg.world.ranks, 100000));
  if (world < 1 || world > 256)
    fail(ErrorCode::kInvalidArgument,
         strcat(o.ranks ? "--ranks " : "world.ranks ", world,
                ": strata train runs 1..256 in-process ranks (use mpirun for more)"));
  return world;
}

// One rank's error, its message prefixed with the rank; the exit code of the error it stands for
// (or 2 when any failed rank's error was bad input).
class RankError : public Error {
 public:
  RankError(ErrorCode code, const std::string& message, bool bad_input) : Error(code, message) {
    bad_input_ = bad_input;
  }
};

// Several in-process ranks: every failed rank's own error reaches the user, each once, as
// "rank R: ..." (a rank's error often only points at another's: "rank 1 failed (io; see that
// rank's error)"). The first failed rank's is thrown (main prints it, last); the others are printed
// here. Returns when no rank failed.
void throw_rank_failures(const std::vector<std::exception_ptr>& errors) {
  int first = -1;
  bool bad_input = false;
  std::vector<std::pair<ErrorCode, std::string>> failed(errors.size());
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    ErrorCode code = ErrorCode::kInternal;
    std::string what;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const Error& e) {
      code = e.code();
      what = e.what();
      bad_input = bad_input || e.exit_code() == 2;
    } catch (const std::exception& e) {
      what = e.what();
    }
    failed[r] = {code, strcat("rank ", r, ": ", what)};
    if (first < 0) {
      first = static_cast<int>(r);
    } else {
      std::cout.flush();
      std::cerr << "strata: error: " << printable_lines(failed[r].second) << "\n";
    }
  }
  if (first < 0) return;
  const auto& [code, what] = failed[static_cast<std::size_t>(first)];
  throw RankError(code, what, bad_input);
}

// Runs rank(r) for r < world, one thread each; returns rank 0's outcome; once every thread ended,
// throws the first failure in rank order (with several ranks: see throw_rank_failures).
RankOutcome run_rank_threads(int world, const std::function<RankOutcome(int)>& rank) {
  RankOutcome outcome;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  RankLogGroup warnings(world, world);  // each warning once, naming the ranks
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      RankLogScope scope(warnings, r);
      try {
        RankOutcome res = rank(r);
        if (r == 0) outcome = std::move(res);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  if (world == 1 && errors[0]) std::rethrow_exception(errors[0]);
  throw_rank_failures(errors);
  return outcome;
}

// In-process ranks: one thread each.
Launch train_inprocess(Config cfg, const Options& o) {
  Launch run;
  const int world = run.world = inprocess_world(cfg, o);
  if (cfg.runtime.cpu_threads == 0)
    cfg.runtime.cpu_threads =
        std::max(1u, std::thread::hardware_concurrency() / static_cast<unsigned>(world));
  auto comms = make_inprocess_communicators(world, cfg.runtime.collective_timeout_s);
  run.backend = comms[0]->backend_name();
  run.outcome = run_rank_threads(
      world, [&](int r) { return train_rank(cfg, *comms[static_cast<std::size_t>(r)], o); });
  return run;
}

// A private directory for the NCCL id file of one launch (F16: never a previous run's id),
// removed with everything in it.
class BootstrapDir {
 public:
  BootstrapDir() {
    std::string t = (std::filesystem::temp_directory_path() / "strata-train-XXXXXX").string();
    if (::mkdtemp(t.data()) == nullptr)
      throw IoError("mkdtemp", t, 0, 0, errno, "train: the NCCL bootstrap directory");
    path_ = t;
  }
  ~BootstrapDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  BootstrapDir(const BootstrapDir&) = delete;
  BootstrapDir& operator=(const BootstrapDir&) = delete;
  std::string file() const { return path_ + "/nccl-id"; }

 private:
  std::string path_;
};

// runtime.communicator nccl: under mpirun one rank per process (train_mpi); otherwise in-process
// ranks, one thread and one GPU each (rank r on GPU r, as the engine picks it: world.ranks and
// world.ranks_per_node become the world), the NCCL id through a file.
Launch train_nccl(Config cfg, const Options& o) {
  if (launched_by_mpi()) return train_mpi(cfg, o, true);
  Launch run;
  const int world = run.world = inprocess_world(cfg, o);
  const int gpus = static_cast<int>(query_cuda_devices().devices.size());
  if (gpus < world)
    fail(ErrorCode::kUnsupported,
         strcat("train: runtime.communicator nccl with ", world, " in-process ranks needs ", world,
                " GPUs (one per rank); ", gpus, " visible"));
  cfg.world.ranks = cfg.world.ranks_per_node = static_cast<std::uint32_t>(world);
  if (cfg.runtime.cpu_threads == 0)
    cfg.runtime.cpu_threads =
        std::max(1u, std::thread::hardware_concurrency() / static_cast<unsigned>(world));
  const BootstrapDir dir;
  run.backend = "nccl";
  run.outcome = run_rank_threads(world, [&](int r) {
    NcclBootstrap boot;
    boot.file = dir.file();
    boot.rank = r;
    boot.size = world;
    auto comm = make_nccl_communicator(boot, local_device_ordinal(r, world, gpus),
                                       cfg.runtime.collective_timeout_s);
    return train_rank(cfg, *comm, o);
  });
  return run;
}

// What the reports derive from rank 0's outcome.
struct Totals {
  bool trained = false;
  double first = 0, last = 0;  // the first and last step's loss
  int ran = 0;                 // steps run
  std::uint64_t params = 0;    // the MLP's parameters
};

Totals totals(const Options& o, const RankOutcome& outcome) {
  Totals t;
  t.trained = !outcome.steps.empty();
  t.first = t.trained ? outcome.steps.front().loss : 0.0;
  t.last = t.trained ? outcome.steps.back().loss : 0.0;
  t.ran = static_cast<int>(outcome.steps.size());
  cli::MlpModel shape_only({16, static_cast<std::size_t>(o.hidden), 4},
                           static_cast<std::uint64_t>(o.seed));
  t.params = shape_only.parameters();
  return t;
}

// The --json report.
void print_json(const Config& cfg, const Options& o, const Launch& run, double wall) {
  const RankOutcome& outcome = run.outcome;
  const auto& st = outcome.stats;
  const int world = run.world;
  const Totals t = totals(o, outcome);
  nlohmann::json j;
  j["stage"] = cfg.zero.stage;
  j["ranks"] = world;
  j["batch"] = o.batch;  // per rank and step
  j["accumulate"] = o.accumulate;
  j["communicator"] = run.backend;
  j["params"] = t.params;
  j["padded_params"] = outcome.flat_size;
  j["precision"] = {{"params", dtype_name(cfg.precision.params)},
                    {"grads", dtype_name(cfg.precision.grads)}};
  j["initial_loss"] = t.trained ? nlohmann::json(t.first) : nlohmann::json();
  j["final_loss"] = t.trained ? nlohmann::json(t.last) : nlohmann::json();
  j["skipped_steps"] = st.skipped_steps;
  j["loss_scale"] = st.loss_scale;
  auto& steps = j["steps"] = nlohmann::json::array();
  for (auto& s : outcome.steps)
    steps.push_back({{"step", s.step},
                     {"loss", s.loss},
                     {"grad_norm", s.grad_norm},
                     {"loss_scale", s.loss_scale},
                     {"applied", s.applied},
                     {"seconds", s.seconds},
                     {"samples_per_second", s.samples_per_second}});
  if (!o.checkpoint_dir.empty()) {
    nlohmann::json c;
    c["dir"] = o.checkpoint_dir;
    c["resumed_from_step"] =
        outcome.resumed_from >= 0 ? nlohmann::json(outcome.resumed_from) : nlohmann::json();
    auto& saves = c["saves"] = nlohmann::json::array();
    for (auto& v : outcome.saves)
      saves.push_back({{"step", v.step},
                       {"seconds", v.seconds},
                       {"blocked_s", v.seconds},
                       {"mode", v.async ? "async" : "blocking"}});
    // Everything checkpoints blocked the loop for: the save calls, and steps that waited for a
    // writer to make room for their copy-on-write (EngineStats::checkpoint_blocked_s).
    c["checkpoint_blocked_s"] = outcome.stats.checkpoint_blocked_s;
    j["checkpoint"] = c;
  }
  nlohmann::json bytes;
  for (std::size_t k = 0; k < kCollectiveKinds; ++k)
    bytes[collective_name(static_cast<CollectiveKind>(k))] = st.comm.bytes_sent[k];
  j["rank0_bytes_sent"] = bytes;
  j["seconds"] = {{"wall", wall},      {"step", st.step_s},           {"reduce", st.reduce_s},
                  {"norm", st.norm_s}, {"optimizer", st.optimizer_s}, {"gather", st.gather_s}};
  j["params_per_second"] = wall > 0 ? static_cast<double>(t.params) * t.ran / wall : 0.0;
  j["samples_per_second"] = wall > 0 ? static_cast<double>(o.batch) * world * t.ran / wall : 0.0;
  std::cout << j.dump(2) << "\n";
}

// The one-line summary.
void print_summary(const Config& cfg, const Options& o, const Launch& run, double wall) {
  const RankOutcome& outcome = run.outcome;
  const auto& st = outcome.stats;
  const int world = run.world;
  const Totals t = totals(o, outcome);
  if (!t.trained) {
    std::cout << "nothing to train: the checkpoint in " << o.checkpoint_dir
              << " is already at step " << outcome.resumed_from << " (--steps " << o.steps << ")\n";
  } else {
    std::cout << "trained " << t.params << " parameters, ZeRO stage " << cfg.zero.stage << ", "
              << world << " " << run.backend << " rank(s), " << dtype_name(cfg.precision.params)
              << " params / " << dtype_name(cfg.precision.grads) << " grads: loss " << t.first
              << " -> " << t.last << " in steps " << outcome.steps.front().step << ".."
              << outcome.steps.back().step << " (" << st.skipped_steps
              << " skipped in all), rank 0 sent " << st.comm.total_bytes_sent() << " bytes, "
              << wall << " s, " << static_cast<double>(o.batch) * world * t.ran / wall
              << " samples/s\n";
  }
}

int run(const Options& given) {
  Config cfg = load_config(given.config, given.overrides);
  Options o = given;
  if (!o.accumulate_given) o.accumulate = static_cast<int>(cfg.train.accumulate);
  check_options(o);
  const bool use_mpi = cfg.runtime.communicator == CommBackend::kMpi ||
                       (cfg.runtime.communicator == CommBackend::kAuto && launched_by_mpi());
  auto t0 = std::chrono::steady_clock::now();
  const Launch launch = cfg.runtime.communicator == CommBackend::kNccl ? train_nccl(cfg, o)
                        : use_mpi                                      ? train_mpi(cfg, o, false)
                                                                       : train_inprocess(cfg, o);
  if (!launch.report) return 0;
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (o.json)
    print_json(cfg, o, launch, wall);
  else
    print_summary(cfg, o, launch, wall);
  return 0;
}

const bool kRegistered = strata::cli::register_command(
    {"train",
     "Train a small MLP through the ZeRO engine (in-process ranks or mpirun; NCCL on GPUs)",
     [](CLI::App& cmd) {
       auto o = std::make_shared<Options>();
       cmd.add_option("config", o->config, "YAML configuration")->required();
       cmd.add_option("--steps", o->steps,
                      "Training steps in all (a resumed run continues up to this step)")
           ->capture_default_str()
           ->check(CLI::PositiveNumber);
       cmd.add_option("--ranks", o->ranks,
                      "In-process ranks (threads), 1..256; default world.ranks; under mpirun the "
                      "MPI world size")
           ->check(CLI::Range(1, 256));
       cmd.add_option("--batch", o->batch, "Samples per rank and step")->capture_default_str();
       cmd.add_option_function<int>(
           "--accumulate",
           [o](const int& k) {
             o->accumulate = k;
             o->accumulate_given = true;
           },
           "Micro-batches per step (gradient accumulation): --batch / K samples each, one "
           "backward each, their gradients summed (each scaled by 1/K); default: the config's "
           "train.accumulate (1)");
       cmd.add_option("--hidden", o->hidden, "Hidden units of the MLP")->capture_default_str();
       cmd.add_option("--seed", o->seed, "Model and data seed (>= 0)")
           ->capture_default_str()
           ->check(CLI::NonNegativeNumber);
       cmd.add_option(
           "--checkpoint-dir", o->checkpoint_dir,
           "Save checkpoints here (after every --save-every steps and after the last step)");
       cmd.add_option("--save-every", o->save_every,
                      "Steps between checkpoints (default: only after the last)")
           ->check(CLI::PositiveNumber);
       cmd.add_flag("--blocking-saves", o->blocking_saves,
                    "--save-every saves wait for their writes (default: asynchronous: a snapshot, "
                    "then the shards are written while training goes on and committed by a step "
                    "once every shard is durable, or by the next save; the last save waits; "
                    "each save prints how long it blocked training)");
       cmd.add_flag(
           "--resume", o->resume,
           "Continue from the checkpoint in --checkpoint-dir if there is one (any world size and "
           "stage; --hidden, --batch, --accumulate and --seed as recorded in its train.json)");
       cmd.add_flag("--json", o->json, "Print one JSON document");
       strata::cli::add_set_option(cmd, o->overrides);
       return [o]() -> int { return run(*o); };
     }});

}  // namespace
}  // namespace cmd_train
