// `strata train CONFIG [--steps N] [--ranks N] [--json]`: the example training loop. Trains a
// two-layer MLP on synthetic regression through the ZeRO Engine (zero.stage, precision.*,
// optimizer.* from the config) on in-process ranks (threads), or one rank per process under
// mpirun, printing the loss as it falls.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli/command.hpp"
#include "comm/numeric.hpp"
#include "strata/communicator.hpp"
#include "strata/config.hpp"
#include "strata/engine.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#include "cli/mlp_model.hpp"

namespace {

using namespace strata;

struct Options {
  std::string config;
  std::vector<std::string> overrides;
  int steps = 50;
  int ranks = 0;  // 0: 1 in-process rank, or the MPI world under mpirun
  int batch = 32;
  int hidden = 64;
  std::uint64_t seed = 1;
  bool json = false;
};

struct StepRecord {
  int step;
  double loss;
  double grad_norm;
  double loss_scale;
  bool applied;
};

struct RankOutcome {
  std::vector<StepRecord> steps;
  EngineStats stats;
  std::size_t flat_size = 0;
};

// One rank's training loop. Rank 0's records are the ones reported (the loss is the mean over
// all ranks' batches, exchanged through the communicator).
RankOutcome train_rank(const Config& cfg, Communicator& comm, const Options& o) {
  cli::MlpModel model({16, static_cast<std::size_t>(o.hidden), 4}, o.seed);
  Engine engine(cfg, comm);
  std::vector<TensorId> ids;
  for (std::size_t t = 0; t < cli::MlpModel::kTensors; ++t)
    ids.push_back(engine.add_parameter(model.tensor_name(t), model.initial(t)));
  engine.finalize();
  const DType gdt = engine.grad_dtype();
  RankOutcome out;
  out.flat_size = engine.partition().flat_size();
  std::vector<std::vector<float>> params(ids.size()), grads;
  std::vector<unsigned char> gbuf;
  for (int s = 0; s < o.steps; ++s) {
    model.make_batch(comm.rank(), static_cast<std::uint64_t>(s), static_cast<std::size_t>(o.batch));
    // Forward, layer by layer: at stage 3 each layer is gathered only while it is used (and the
    // engine prefetches the next layer from the second step on); no-ops at stages 0-2.
    const std::vector<std::vector<TensorId>> layers{{ids[0], ids[1]}, {ids[2], ids[3]}};
    for (const auto& layer : layers) {
      engine.gather(layer);
      for (TensorId id : layer) {
        params[id].resize(engine.numel(id));
        engine.read_param(id, params[id]);
      }
      engine.release(layer);
    }
    double loss = model.forward_backward(params, grads);
    const float scale = static_cast<float>(engine.loss_scale());
    // Backward, last layer first: the layer is gathered again (a ZeRO-3 loop does not keep it
    // between forward and backward), its gradients are handed in as they are produced (stages
    // 2-3 reduce-scatter full buckets at once, overlapping the rest of backward).
    for (std::size_t l = layers.size(); l-- > 0;) {
      engine.gather(layers[l]);
      for (std::size_t j = layers[l].size(); j-- > 0;) {
        const TensorId k = layers[l][j];
        gbuf.resize(grads[k].size() * comm::elem_size(gdt));
        for (std::size_t i = 0; i < grads[k].size(); ++i)
          comm::store_elem(gbuf.data(), i, gdt, grads[k][i] * scale);
        engine.set_gradient(k, gbuf.data());
      }
      engine.release(layers[l]);
    }
    StepResult r = engine.step();
    float l = static_cast<float>(loss), total = 0;
    comm.all_reduce(&l, &total, 1, DType::kFp32);
    StepRecord rec{s + 1, total / static_cast<float>(comm.size()), r.grad_norm, r.loss_scale, r.applied};
    out.steps.push_back(rec);
    if (comm.rank() == 0 && !o.json)
      std::cout << "step " << rec.step << "  loss " << rec.loss << "  grad_norm " << rec.grad_norm
                << "  loss_scale " << rec.loss_scale << (rec.applied ? "" : "  (skipped: overflow)")
                << std::endl;
  }
  out.stats = engine.stats();
  return out;
}

int run(const Options& o) {
  Config cfg = load_config(o.config, o.overrides);
  if (o.steps < 1) fail(ErrorCode::kInvalidArgument, "--steps must be >= 1");
  if (o.batch < 1 || o.hidden < 1) fail(ErrorCode::kInvalidArgument, "--batch and --hidden must be >= 1");
  const bool use_mpi = cfg.runtime.communicator == CommBackend::kMpi ||
                       (cfg.runtime.communicator == CommBackend::kAuto && launched_by_mpi());
  if (cfg.runtime.communicator == CommBackend::kNccl)
    fail(ErrorCode::kInvalidArgument,
         "strata train keeps its state in host memory: runtime.communicator must be auto, inprocess or mpi");
  const double timeout = cfg.runtime.collective_timeout_s;
  RankOutcome outcome;
  std::string backend;
  int world = 1;
  auto t0 = std::chrono::steady_clock::now();
  if (use_mpi) {
    auto comm = make_mpi_communicator(timeout);
    world = comm->size();
    if (o.ranks && o.ranks != world)
      fail(ErrorCode::kInvalidArgument, strcat("--ranks ", o.ranks, " but mpirun started ", world, " ranks"));
    backend = comm->backend_name();
    log_debug("train: MPI rank ", comm->rank(), " of ", world);
    outcome = train_rank(cfg, *comm, o);
    if (comm->rank() != 0) return 0;  // rank 0 reports
  } else {
    world = o.ranks ? o.ranks : 1;
    if (world < 1 || world > 256) fail(ErrorCode::kInvalidArgument, "--ranks must be in 1..256");
    if (cfg.runtime.cpu_threads == 0)
      cfg.runtime.cpu_threads = std::max(1u, std::thread::hardware_concurrency() / static_cast<unsigned>(world));
    auto comms = make_inprocess_communicators(world, timeout);
    backend = comms[0]->backend_name();
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r)
      threads.emplace_back([&, r] {
        try {
          RankOutcome res = train_rank(cfg, *comms[static_cast<std::size_t>(r)], o);
          if (r == 0) outcome = std::move(res);
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
        }
      });
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto& st = outcome.stats;
  const double first = outcome.steps.front().loss, last = outcome.steps.back().loss;
  cli::MlpModel shape_only({16, static_cast<std::size_t>(o.hidden), 4}, o.seed);
  const double params = static_cast<double>(shape_only.parameters());
  if (o.json) {
    nlohmann::json j;
    j["stage"] = cfg.zero.stage;
    j["ranks"] = world;
    j["communicator"] = backend;
    j["params"] = shape_only.parameters();
    j["padded_params"] = outcome.flat_size;
    j["precision"] = {{"params", dtype_name(cfg.precision.params)}, {"grads", dtype_name(cfg.precision.grads)}};
    j["initial_loss"] = first;
    j["final_loss"] = last;
    j["skipped_steps"] = st.skipped_steps;
    j["loss_scale"] = st.loss_scale;
    auto& steps = j["steps"] = nlohmann::json::array();
    for (auto& s : outcome.steps)
      steps.push_back({{"step", s.step}, {"loss", s.loss}, {"grad_norm", s.grad_norm},
                       {"loss_scale", s.loss_scale}, {"applied", s.applied}});
    nlohmann::json bytes;
    for (std::size_t k = 0; k < kCollectiveKinds; ++k)
      bytes[collective_name(static_cast<CollectiveKind>(k))] = st.comm.bytes_sent[k];
    j["rank0_bytes_sent"] = bytes;
    j["seconds"] = {{"wall", wall}, {"step", st.step_s}, {"reduce", st.reduce_s}, {"norm", st.norm_s},
                    {"optimizer", st.optimizer_s}, {"gather", st.gather_s}};
    j["params_per_second"] = wall > 0 ? params * o.steps / wall : 0.0;
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << "trained " << static_cast<std::size_t>(params) << " parameters, ZeRO stage "
              << cfg.zero.stage << ", " << world << " " << backend << " rank(s), "
              << dtype_name(cfg.precision.params) << " params / " << dtype_name(cfg.precision.grads)
              << " grads: loss " << first << " -> " << last << " in " << o.steps << " steps ("
              << st.skipped_steps << " skipped), rank 0 sent " << st.comm.total_bytes_sent()
              << " bytes, " << wall << " s\n";
  }
  return 0;
}

const bool kRegistered = strata::cli::register_command(
    {"train", "Train a small MLP through the ZeRO engine (in-process ranks or mpirun)",
     [](CLI::App& cmd) {
       auto o = std::make_shared<Options>();
       cmd.add_option("config", o->config, "YAML configuration")->required();
       cmd.add_option("--steps", o->steps, "Training steps")->capture_default_str();
       cmd.add_option("--ranks", o->ranks,
                      "In-process ranks (threads); under mpirun the MPI world size is used");
       cmd.add_option("--batch", o->batch, "Samples per rank and step")->capture_default_str();
       cmd.add_option("--hidden", o->hidden, "Hidden units of the MLP")->capture_default_str();
       cmd.add_option("--seed", o->seed, "Model and data seed")->capture_default_str();
       cmd.add_flag("--json", o->json, "Print one JSON document");
       strata::cli::add_set_option(cmd, o->overrides);
       return [o]() -> int { return run(*o); };
     }});

}  // namespace
