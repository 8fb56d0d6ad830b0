// `strata profile CONFIG [--quick|--full] [--json] [--write-config tuned.yaml]`: measures the
// configured tiers' links on this machine, predicts the step overhead and checks the prediction
// against a sample step (include/strata/profile.hpp).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "cli/command.hpp"
#include "strata/communicator.hpp"
#include "strata/config.hpp"
#include "strata/error.hpp"
#include "strata/profile.hpp"
#include "strata/units.hpp"

// The report's records whose JSON keys are their field names (nlohmann's to_json, found by ADL).
namespace strata {
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(SampleRun, measured_s, repeats, measured_median_s, predicted_s,
                                   error)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(PathInfo, path, filesystem, device, mount_point, free_bytes,
                                   temporary)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Environment, hostname, kernel, cpu_model, cores, memory_bytes,
                                   memlock_limit_bytes, gpu, has_gpu, adam_path, load_average_1m,
                                   timestamp_utc, paths)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(CopyPoint, direction, pinned, bytes, seconds, bytes_per_second)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(CollectivePoint, collective, backend, ranks, bytes, seconds,
                                   algbw_bytes_per_second, busbw_bytes_per_second)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(OverlapPrediction, backward_s, chunks, pieces, window_s,
                                   optimizer_s, speculative_s, commit_s, device_share, exposed_s,
                                   backward_and_step_s, serial_s)
}  // namespace strata

namespace cmd_profile {
namespace {

using nlohmann::json;
using strata::format_bytes;
using strata::format_rate;

// The --write-config file, opened (and created if missing) before anything is measured, so that a
// bad path fails at once with errno; written in full at the end; a file this run created is
// removed again if the run fails. An existing file keeps its contents until the write.
class OutputFile {
 public:
  OutputFile() = default;
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile() {
    if (fd_ >= 0) ::close(fd_);
    if (created_ && !written_) ::unlink(path_.c_str());
  }
  explicit operator bool() const { return fd_ >= 0; }
  void open(const std::string& path, const char* option) {
    path_ = path;
    option_ = option;
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ >= 0) {
      created_ = true;
      return;
    }
    if (errno == EEXIST) fd_ = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd_ < 0) {
      const int e = errno;
      strata::fail(strata::ErrorCode::kInvalidArgument,
                   strata::strcat(option, ": cannot open ", path,
                                  " for writing: ", std::strerror(e), " (errno ", e, ")"));
    }
    struct stat st {};
    if (::fstat(fd_, &st) == 0 && S_ISDIR(st.st_mode))
      strata::fail(strata::ErrorCode::kInvalidArgument,
                   std::string(option) + ": " + path + " is a directory");
  }
  void write(const std::string& text) {
    struct stat st {};
    if (::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode) && ::ftruncate(fd_, 0) != 0)
      fail_io("ftruncate", 0);
    std::size_t done = 0;
    while (done < text.size()) {
      const ssize_t n =
          ::pwrite(fd_, text.data() + done, text.size() - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail_io("pwrite", done);
      done += static_cast<std::size_t>(n);
    }
    written_ = true;
  }

 private:
  [[noreturn]] void fail_io(const char* op, std::size_t offset) {
    throw strata::IoError(op, path_, offset, 0, errno, std::string("writing ") + option_);
  }
  std::string path_;
  const char* option_ = "";
  int fd_ = -1;
  bool created_ = false, written_ = false;
};

struct Options : strata::cli::ConfigArgs {
  bool quick = false, full = false, tiny = false, json = false;
  std::string write_config;
  std::string json_file;  // the JSON report also goes here (beside the human report on stdout)
  double target_overhead = 1.0;
  unsigned repeats = 0;
  double backward = -1;  // --backward SECONDS: predict the overlapped step (< 0: not asked)
};

json null_if_empty(const std::string& s) { return s.empty() ? json(nullptr) : json(s); }

json prediction_json(const strata::StepPrediction& p) {
  json legs = json::array();
  for (std::size_t i = 0; i < p.legs.size(); ++i) {
    const auto& l = p.legs[i];
    legs.push_back({{"count", p.legs_count[i]},
                    {"elements", l.elements},
                    {"nvme_read_s", l.nvme_read_s},
                    {"host_to_device_s", l.h2d_s},
                    {"device_to_host_s", l.d2h_s},
                    {"adam_s", l.adam_s},
                    {"nvme_write_s", l.nvme_write_s},
                    {"cpu_s", l.cpu_s}});
  }
  return {{"optimizer_elements", p.optimizer_elements},
          {"offloaded_elements", p.offloaded_elements},
          {"sub_group_elements", p.sub_group_elements},
          {"sub_groups", p.sub_groups},
          {"sub_group_legs", legs},
          {"nvme_read_s", p.nvme_read_s},
          {"nvme_write_s", p.nvme_write_s},
          {"host_to_device_s", p.h2d_s},
          {"device_to_host_s", p.d2h_s},
          {"adam_s", p.adam_s},
          {"adam_memory_s", p.adam_memory_s},
          {"adam_gpu_s", p.adam_gpu_s},
          {"network_s", p.network_s},
          {"optimizer_step_serial_s", p.serial_s},
          {"optimizer_step_pipelined_s", p.pipelined_s},
          {"transfer_overhead_serial_s", p.overhead_serial_s},
          {"transfer_overhead_pipelined_s", p.overhead_pipelined_s},
          {"notes", p.notes}};
}

json offload_json(const strata::OffloadConfig& o) {
  auto t = [](const strata::OffloadTarget& x) {
    return json{{"tier", strata::tier_name(x.tier)},
                {"fraction", x.fraction},
                {"pin_memory", x.pin_memory}};
  };
  return {{"optimizer", t(o.optimizer)}, {"gradients", t(o.gradients)}, {"params", t(o.params)}};
}

json adam_json(const strata::AdamMeasure& a) {
  if (!a.measured) return {{"measured", false}, {"skipped", a.skipped}};
  return {{"measured", true},
          {"device", a.device},
          {"elements", a.elements},
          {"seconds", a.seconds},
          {"params_per_second", a.params_per_second},
          {"bytes_per_second", a.bytes_per_second},
          {"out_of_place_factor", a.out_of_place_factor},
          {"host_copy_bytes_per_second", a.host_copy_bytes_per_second}};
}

json pool_json(const strata::PoolUse& p) {
  return {{"configured_buffers", p.configured_buffers},
          {"configured_buffer_size", p.configured_buffer_size},
          {"buffers", p.buffers},
          {"buffer_size", p.buffer_size},
          {"memlock_limit_bytes", p.memlock_limit == ~0ULL ? json(nullptr) : json(p.memlock_limit)},
          {"reason", p.reason}};
}

json io_points_json(const std::vector<strata::IoPoint>& points) {
  json io = json::array();
  for (const auto& p : points)
    io.push_back({{"path", p.path},
                  {"engine", p.engine},
                  {"op", p.op},
                  {"block_size", p.block_size},
                  {"queue_depth", p.queue_depth},
                  {"rings", p.rings},
                  {"direct", p.direct},
                  {"bytes", p.bytes},
                  {"seconds", p.seconds},
                  {"bytes_per_second", p.bytes_per_second},
                  {"runs_bytes_per_second", p.runs_bps}});
  return io;
}

json model_json(const strata::ProfileReport& r) {
  const auto& b = r.bandwidths;
  const auto& t = r.plan.configured.traffic;
  return {{"bandwidths",
           {{"nvme_read_bytes_per_second", b.nvme_read_bps},
            {"nvme_write_bytes_per_second", b.nvme_write_bps},
            {"nvme_duplex", b.nvme_duplex},
            {"nvme_mixed_bytes_per_second", b.nvme_mixed_bps},
            {"host_to_device_bytes_per_second", b.h2d_bps},
            {"device_to_host_bytes_per_second", b.d2h_bps},
            {"cpu_adam_params_per_second", b.cpu_adam_params_per_s},
            {"gpu_adam_params_per_second", b.gpu_adam_params_per_s},
            {"reduce_scatter_busbw_bytes_per_second", b.reduce_scatter_busbw},
            {"all_gather_busbw_bytes_per_second", b.all_gather_busbw},
            {"cpu_seconds_per_nvme_byte", b.cpu_s_per_nvme_byte},
            {"cpu_seconds_per_adam_element", b.cpu_s_per_adam_element},
            {"cores", b.cores},
            {"network_source", null_if_empty(b.network_source)}}},
          {"layout", r.plan.configured.describe()},
          {"traffic_per_rank_per_step_bytes",
           {{"nvme_read", t.nvme_read},
            {"nvme_write", t.nvme_write},
            {"host_to_device", t.host_to_device},
            {"device_to_host", t.device_to_host},
            {"network", t.network}}},
          {"configured", prediction_json(r.configured)}};
}

json sample_step_json(const strata::SampleStep& s) {
  json j = {{"ran", s.ran},
            {"implementation", s.implementation},
            {"elements_per_sub_group", s.elements_per_sub_group},
            {"sub_groups", s.sub_groups},
            {"nvme_bytes_per_element", s.nvme_bytes_per_element},
            {"tier_read_bytes_per_second", s.tier_read_bps},
            {"tier_write_bytes_per_second", s.tier_write_bps},
            {"adam_params_per_second", s.adam_params_per_s},
            {"tier_mixed_bytes_per_second", s.tier_mixed_bps},
            {"tier_mixed_runs_bytes_per_second", s.tier_mixed_runs},
            {"tier_read_runs_bytes_per_second", s.tier_read_runs},
            {"tier_write_runs_bytes_per_second", s.tier_write_runs},
            {"adam_runs_params_per_second", s.adam_runs},
            {"pinned_pool", pool_json(s.pool)},
            {"serial", s.serial},
            {"pipelined", s.pipelined}};
  json eng = {{"ran", s.engine_ran}, {"skipped", null_if_empty(s.engine_skipped)}};
  if (s.engine_ran) {
    eng["implementation"] =
        "zero layer: OffloadStateStore::update (src/zero), via zero::run_step_bench";
    eng["chunks"] = s.engine_chunks;
    eng["pinned_buffers"] = s.engine_buffers;
    eng["pinned_buffer_size"] = s.engine_buffer_size;
    eng["pinned_pool"] = pool_json(s.engine_pool);
    eng["read_s"] = s.engine_read_s;
    eng["update_s"] = s.engine_update_s;
    eng["write_s"] = s.engine_write_s;
    eng["serial"] = s.engine_serial;
    eng["pipelined"] = s.engine_pipelined;
  }
  j["engine_step"] = eng;
  return j;
}

json recommendation_json(const strata::ProfileReport& r) {
  json iorec = json::array();
  for (const auto& x : r.io_recommendations)
    iorec.push_back({{"path", x.path},
                     {"engine", x.engine},
                     {"block_size", x.block_size},
                     {"queue_depth", x.queue_depth},
                     {"rings", x.rings},
                     {"read_bytes_per_second", x.read_bps},
                     {"write_bytes_per_second", x.write_bps},
                     {"configured_kept", x.configured_kept},
                     {"noise", x.noise},
                     {"reason", x.reason}});
  json considered = json::array();
  for (const auto& o : r.placement.considered)
    considered.push_back({{"stage", o.stage},
                          {"description", o.description},
                          {"offload", offload_json(o.offload)},
                          {"fits", o.fits},
                          {"verdict", o.verdict},
                          {"activation_checkpointing", o.checkpointing},
                          {"gpu_bytes_per_rank", o.gpu_bytes_per_rank},
                          {"transfer_overhead_pipelined_s", o.overhead_pipelined_s},
                          {"optimizer_step_pipelined_s", o.step_pipelined_s}});
  json placement = {
      {"found", r.placement.found}, {"reason", r.placement.reason}, {"considered", considered}};
  if (r.placement.found)
    placement["choice"] = {
        {"stage", r.placement.choice.stage},
        {"description", r.placement.choice.description},
        {"offload", offload_json(r.placement.choice.offload)},
        {"transfer_overhead_pipelined_s", r.placement.choice.overhead_pipelined_s}};
  return {{"io", iorec}, {"placement", placement}, {"tuned_notes", r.tuned_notes}};
}

json node_sharing_json(const strata::NodeSharing& sh) {
  return {{"ranks_per_node", sh.ranks_per_node},
          {"local_processes", sh.local_processes},
          {"nvme_devices", sh.nvme_devices},
          {"nvme_streams", sh.nvme_streams},
          {"nvme_single_read_bytes_per_second", sh.nvme_single_read_bps},
          {"nvme_single_write_bytes_per_second", sh.nvme_single_write_bps},
          {"nvme_aggregate_read_bytes_per_second", sh.nvme_aggregate_read_bps},
          {"nvme_aggregate_write_bytes_per_second", sh.nvme_aggregate_write_bps},
          {"nvme_read_factor", sh.nvme_read_factor},
          {"nvme_write_factor", sh.nvme_write_factor},
          {"cpu_factor", sh.cpu_factor},
          {"cores_per_rank", sh.cores_per_rank},
          {"notes", sh.notes}};
}

json engine_check_json(const strata::EngineCheck& ec) {
  json ecj = {{"ran", ec.ran}, {"skipped", null_if_empty(ec.skipped)}};
  if (ec.ran) {
    ecj["ranks"] = ec.ranks;
    ecj["backend"] = ec.backend;
    ecj["layout"] = ec.layout;
    ecj["elements"] = ec.elements;
    ecj["measured_s"] = ec.measured_s;
    ecj["measured_median_s"] = ec.measured_median_s;
    ecj["predicted_s"] = ec.predicted_s;
    ecj["error"] = ec.error;
    ecj["prediction"] = prediction_json(ec.prediction);
    ecj["grad_passes_s"] = ec.grad_passes_s;
    ecj["predicted_optimizer_s"] = ec.predicted_optimizer_s;
    ecj["optimizer_from"] = ec.optimizer_from;
    ecj["engine_phases_s"] = {{"reduce", ec.reduce_s},
                              {"norm", ec.norm_s},
                              {"optimizer", ec.optimizer_s},
                              {"gather", ec.gather_s}};
  }
  return ecj;
}

// --backward: the configured step hidden behind a backward (strata::predict_overlap), the
// prediction's members under their own names and the config's optimizer.overlap.
json overlap_json(const strata::OverlapPrediction& v, const strata::Config& c) {
  json j = v;
  j["config_overlap"] = strata::optimizer_overlap_name(c.optimizer.overlap);
  return j;
}

json report_json(const strata::ProfileReport& r) {
  json j;
  j["config"] = r.config_source;
  j["mode"] = strata::profile_mode_name(r.mode);
  j["elapsed_s"] = r.elapsed_s;
  j["phase_seconds"] = json::object();
  for (const auto& [name, sec] : r.phase_seconds) j["phase_seconds"][name] = sec;
  j["environment"] = r.environment;
  j["notes"] = r.notes;
  j["nvme"] = {{"points", io_points_json(r.io)}};
  j["host_device_copies"] = {{"skipped", null_if_empty(r.copies_skipped)}, {"points", r.copies}};
  j["cpu_adam"] = adam_json(r.cpu_adam);
  j["gpu_adam"] = adam_json(r.gpu_adam);
  j["memory_bandwidth"] = {{"kernel", "triad"},
                           {"threads", r.triad_threads},
                           {"bytes_per_second", r.triad_bytes_per_second}};
  j["collectives"] = {{"skipped", null_if_empty(r.collectives_skipped)}, {"points", r.collectives}};
  j["model"] = model_json(r);
  j["sample_step"] = sample_step_json(r.sample);
  j["recommendation"] = recommendation_json(r);
  j["node_sharing"] = node_sharing_json(r.sharing);
  j["engine_check"] = engine_check_json(r.engine_check);
  j["launch"] = {{"rank", r.rank}, {"world", r.world}};
  return j;
}

std::string cell(const std::string& s, std::size_t w) {
  return s.size() >= w ? s + " " : s + std::string(w - s.size(), ' ');
}
std::string rcell(const std::string& s, std::size_t w) {
  return s.size() >= w ? " " + s : std::string(w - s.size(), ' ') + s;
}
std::string secs(double s) {
  char buf[32];
  if (s >= 100)
    std::snprintf(buf, sizeof buf, "%.0f s", s);
  else if (s >= 1)
    std::snprintf(buf, sizeof buf, "%.2f s", s);
  else
    std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  return buf;
}
std::string pct(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%+.1f%%", f * 100.0);
  return buf;
}
std::string fixed2(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", f);
  return buf;
}
std::string rate_params(double p) {
  return strata::format_count(static_cast<std::uint64_t>(p)) + " params/s";
}

// The run, the machine and its NVMe paths.
void print_machine(std::ostream& o, const strata::ProfileReport& r) {
  const auto& e = r.environment;
  o << "strata profile: " << r.config_source << " (" << strata::profile_mode_name(r.mode)
    << " mode, " << secs(r.elapsed_s) << ")\n"
    << "  machine: " << e.kernel << "; " << e.cpu_model << ", " << e.cores << " cores, "
    << format_bytes(e.memory_bytes, true) << " memory; load " << e.load_average_1m << "\n"
    << "  GPU: " << e.gpu << "\n";
  for (const auto& p : e.paths)
    o << "  nvme path " << p.path << ": " << p.filesystem << " on " << p.device << " ("
      << format_bytes(p.free_bytes) << " free)" << (p.temporary ? ", temporary" : "") << "\n";
  for (const auto& n : r.notes) o << "  note: " << n << "\n";
}

// NVMe: one table per path, engine, rings and op; rows block sizes, columns queue depths.
void print_nvme(std::ostream& o, const strata::ProfileReport& r) {
  std::map<std::tuple<std::string, std::string, std::uint32_t, std::string>,
           std::map<std::uint64_t, std::map<std::uint32_t, double>>>
      tables;
  std::set<std::uint32_t> qds;
  for (const auto& p : r.io) {
    tables[{p.path, p.engine, p.rings, p.op}][p.block_size][p.queue_depth] = p.bytes_per_second;
    qds.insert(p.queue_depth);
  }
  o << "\nNVMe through the strata I/O engine (throughput; rows block size, columns queue depth):\n";
  for (const auto& [key, rows] : tables) {
    const auto& [path, engine, rings, op] = key;
    o << "  " << op << ", " << engine << " x" << rings << " ring(s), " << path << "\n    "
      << cell("block", 9);
    for (auto q : qds) o << rcell("qd " + std::to_string(q), 12);
    o << "\n";
    for (const auto& [bs, cols] : rows) {
      o << "    " << cell(format_bytes(bs, true), 9);
      for (auto q : qds) {
        auto it = cols.find(q);
        o << rcell(it == cols.end() ? "-" : format_rate(it->second), 12);
      }
      o << "\n";
    }
  }
}

// Host <-> device copies, pinned and pageable, per size.
void print_copies(std::ostream& o, const strata::ProfileReport& r) {
  o << "\nHost <-> device copies: ";
  if (!r.copies_skipped.empty()) {
    o << r.copies_skipped << "\n";
  } else {
    o << "\n    " << cell("size", 10) << rcell("h2d pinned", 13) << rcell("d2h pinned", 13)
      << rcell("h2d pageable", 14) << rcell("d2h pageable", 14) << "\n";
    std::map<std::uint64_t, std::map<std::string, double>> rows;
    for (const auto& c : r.copies)
      rows[c.bytes][(c.direction == "host_to_device" ? "h2d" : "d2h") +
                    std::string(c.pinned ? "p" : "g")] = c.bytes_per_second;
    for (auto& [bytes, m] : rows)
      o << "    " << cell(format_bytes(bytes, true), 10) << rcell(format_rate(m["h2dp"]), 13)
        << rcell(format_rate(m["d2hp"]), 13) << rcell(format_rate(m["h2dg"]), 14)
        << rcell(format_rate(m["d2hg"]), 14) << "\n";
  }
}

// CPU Adam, the triad reference, GPU Adam.
void print_compute(std::ostream& o, const strata::ProfileReport& r) {
  o << "\nCompute:\n";
  const auto& ca = r.cpu_adam;
  o << "  CPU Adam (" << ca.device << ", " << strata::format_count(ca.elements)
    << " elements): " << rate_params(ca.params_per_second) << ", "
    << format_rate(ca.bytes_per_second) << " of state";
  if (ca.out_of_place_factor > 0)
    o << "; out of place (as the speculative update writes) x" << fixed2(ca.out_of_place_factor)
      << " the time; a host copy " << format_rate(ca.host_copy_bytes_per_second) << " (1 thread)";
  o << "\n  memory bandwidth (triad, " << r.triad_threads
    << " threads): " << format_rate(r.triad_bytes_per_second);
  if (r.triad_bytes_per_second > 0)
    o << "; CPU Adam reaches "
      << static_cast<int>(std::lround(100.0 * ca.bytes_per_second / r.triad_bytes_per_second))
      << "% of it";
  o << "\n  GPU Adam: "
    << (r.gpu_adam.measured
            ? rate_params(r.gpu_adam.params_per_second) + " (" + r.gpu_adam.device + ")"
            : r.gpu_adam.skipped)
    << "\n";
}

// The collectives measured (or why not).
void print_collectives(std::ostream& o, const strata::ProfileReport& r) {
  o << "\nCollectives (busbw = algbw x (n-1)/n): ";
  if (r.collectives.empty())
    o << r.collectives_skipped << "\n";
  else {
    o << (r.collectives_skipped.empty() ? "" : r.collectives_skipped) << "\n";
    for (const auto& c : r.collectives)
      o << "  " << cell(c.collective, 15) << cell(c.backend + " x" + std::to_string(c.ranks), 14)
        << rcell(format_bytes(c.bytes, true), 10) << "  busbw "
        << rcell(format_rate(c.busbw_bytes_per_second), 11) << "  algbw "
        << format_rate(c.algbw_bytes_per_second) << "\n";
  }
}

// The sample step through the real tiers, and the zero layer's step on the same state.
void print_sample_step(std::ostream& o, const strata::ProfileReport& r) {
  const auto& s = r.sample;
  o << "\nSample step through the real tiers (" << s.sub_groups << " sub-groups x "
    << strata::format_count(s.elements_per_sub_group) << " elements, "
    << format_bytes(s.elements_per_sub_group * s.nvme_bytes_per_element * s.sub_groups, true)
    << " of optimizer state on NVMe):\n"
    << "  legs measured alone" << (r.world > 1 ? " (on every rank at once)" : "")
    << ": tier-store read " << format_rate(s.tier_read_bps) << ", write "
    << format_rate(s.tier_write_bps) << ", read || write-back " << format_rate(s.tier_mixed_bps)
    << ", CPU Adam " << rate_params(s.adam_params_per_s) << "\n"
    << "  pinned pool: " << s.pool.buffers << " x " << format_bytes(s.pool.buffer_size, true)
    << " (configured " << s.pool.configured_buffers << " x "
    << format_bytes(s.pool.configured_buffer_size, true) << "): " << s.pool.reason << "\n"
    << "  " << cell("step", 11) << rcell("predicted", 11) << rcell("measured", 11)
    << rcell("error", 9) << "   (median of " << s.serial.repeats << " runs)\n";
  for (const auto* run : {&s.serial, &s.pipelined})
    o << "  " << cell(run == &s.serial ? "serial" : "pipelined", 11)
      << rcell(secs(run->predicted_s), 11) << rcell(secs(run->measured_median_s), 11)
      << rcell(pct(run->error), 9) << (std::fabs(run->error) <= 0.15 ? "" : "   (outside +-15%)")
      << "\n";

  if (s.engine_ran) {
    o << "  the zero layer's offloaded step on the same state (" << s.engine_chunks << " chunks, "
      << s.engine_buffers << " x " << format_bytes(s.engine_buffer_size, true)
      << " pinned buffers; legs alone: read " << secs(s.engine_read_s) << ", Adam "
      << secs(s.engine_update_s) << ", write " << secs(s.engine_write_s) << "; medians of "
      << s.engine_pipelined.repeats << " rounds):\n"
      << "    its pinned pool: " << s.engine_pool.buffers << " x "
      << format_bytes(s.engine_pool.buffer_size, true) << " (configured "
      << s.engine_pool.configured_buffers << " x "
      << format_bytes(s.engine_pool.configured_buffer_size, true) << "): " << s.engine_pool.reason
      << "\n";
    for (const auto* run : {&s.engine_serial, &s.engine_pipelined})
      o << "  " << cell(run == &s.engine_serial ? "serial" : "pipelined", 11)
        << rcell(secs(run->predicted_s), 11) << rcell(secs(run->measured_median_s), 11)
        << rcell(pct(run->error), 9) << (std::fabs(run->error) <= 0.15 ? "" : "   (outside +-15%)")
        << "\n";
  } else if (!s.engine_skipped.empty()) {
    o << "  zero layer's offloaded step: " << s.engine_skipped << "\n";
  }
}

// How the node's ranks share its disk and cores.
void print_node_sharing(std::ostream& o, const strata::ProfileReport& r) {
  const auto& sh = r.sharing;
  char factors[160];
  std::snprintf(factors, sizeof factors,
                "NVMe x%.2f read, x%.2f write; CPU Adam x%.2f; %.2g cores per rank",
                sh.nvme_read_factor, sh.nvme_write_factor, sh.cpu_factor, sh.cores_per_rank);
  o << "\nRanks on a node (" << sh.ranks_per_node << " per node, " << sh.local_processes
    << " measured at once here): " << factors << "\n";
  for (const auto& n : sh.notes) o << "  " << n << "\n";
  o << "  network: "
    << (r.bandwidths.network_source.empty() ? r.collectives_skipped : r.bandwidths.network_source)
    << "\n";
}

// The engine check: a real multi-rank step against its prediction.
void print_engine_check(std::ostream& o, const strata::ProfileReport& r) {
  const auto& ec = r.engine_check;
  o << "\nEngine check (a real multi-rank Engine step against its prediction): ";
  if (!ec.ran) {
    o << ec.skipped << "\n";
  } else {
    o << ec.ranks << " ranks over " << ec.backend << ", " << ec.layout << ", "
      << strata::format_count(ec.elements) << " parameters\n"
      << "  " << cell("step", 11) << rcell("predicted", 11) << rcell("measured", 11)
      << rcell("error", 9) << "   (median of " << ec.measured_s.size() << " steps, slowest rank)\n"
      << "  " << cell("engine", 11) << rcell(secs(ec.predicted_s), 11)
      << rcell(secs(ec.measured_median_s), 11) << rcell(pct(ec.error), 9)
      << (std::fabs(ec.error) <= 0.15 ? "" : "   (outside +-15%)") << "\n"
      << "  predicted legs: optimizer " << secs(ec.predicted_optimizer_s) << " (pipelined, from "
      << ec.optimizer_from << "), network " << secs(ec.prediction.network_s)
      << " (the step's collectives replayed), gradient copy + the rest of step() "
      << secs(ec.grad_passes_s) << "; the engine's phases: reduce " << secs(ec.reduce_s)
      << ", norm " << secs(ec.norm_s) << ", optimizer " << secs(ec.optimizer_s) << ", gather "
      << secs(ec.gather_s) << "\n";
  }
}

// The model of the configured step, per rank.
void print_prediction(std::ostream& o, const strata::ProfileReport& r) {
  const auto& p = r.configured;
  const auto& t = r.plan.configured.traffic;
  o << "\nPredicted step for the configured layout (" << r.plan.configured.describe()
    << "), per rank:\n"
    << "  bytes per step: nvme read " << format_bytes(t.nvme_read) << ", write "
    << format_bytes(t.nvme_write) << ", host->device " << format_bytes(t.host_to_device)
    << ", device->host " << format_bytes(t.device_to_host) << ", network "
    << format_bytes(t.network) << "\n"
    << "  optimizer: " << strata::format_count(p.offloaded_elements) << " of "
    << strata::format_count(p.optimizer_elements) << " elements off the GPU, " << p.sub_groups
    << " sub-group(s) of " << strata::format_count(p.sub_group_elements) << "\n"
    << "  legs: nvme read " << secs(p.nvme_read_s) << ", adam " << secs(p.adam_s) << ", nvme write "
    << secs(p.nvme_write_s) << ", h2d " << secs(p.h2d_s) << ", d2h " << secs(p.d2h_s)
    << ", network " << secs(p.network_s) << "\n"
    << "  " << cell("", 12) << rcell("optimizer step", 16) << rcell("transfer overhead", 19) << "\n"
    << "  " << cell("serial", 12) << rcell(secs(p.serial_s), 16)
    << rcell(secs(p.overhead_serial_s), 19) << "\n"
    << "  " << cell("pipelined", 12) << rcell(secs(p.pipelined_s), 16)
    << rcell(secs(p.overhead_pipelined_s), 19) << "\n";
  for (const auto& n : p.notes) o << "  note: " << n << "\n";
}

// The recommendations and the tuned config.
void print_recommendation(std::ostream& o, const strata::ProfileReport& r,
                          const std::string& tuned_path) {
  o << "\nRecommendation:\n";
  for (const auto& x : r.io_recommendations)
    o << "  " << x.path << ": engine " << x.engine << ", block_size "
      << format_bytes(x.block_size, true) << ", queue_depth " << x.queue_depth << ", io_threads "
      << x.rings << " (" << x.reason << ")\n";
  o << "  placement: " << r.placement.reason << "\n";
  for (const auto& n : r.tuned_notes) o << "  tuned config: " << n << "\n";
  if (!tuned_path.empty()) o << "  tuned config written to " << tuned_path << "\n";
}

void print_overlap(std::ostream& o, const strata::OverlapPrediction& v, const strata::Config& c) {
  o << "\nWith a backward of " << secs(v.backward_s) << " (optimizer.overlap: the update runs "
    << "during the backward, as the gradients become final):\n";
  if (c.zero.stage < 2) {
    o << "  zero.stage " << c.zero.stage << " reduces the gradients at step(): nothing is final "
      << "during the backward, the step is the serial one (optimizer.overlap needs stage 2-3)\n";
  } else {
    o << "  the gradients become final in " << v.pieces << " piece(s) (zero.reduce_bucket_size "
      << c.zero.reduce_bucket_size << "; " << v.chunks << " chunk(s))";
    if (v.window_s < v.backward_s)  // several ranks: rank 0's range is handed in last
      o << " during the last " << secs(v.window_s) << " of the backward (rank 0's range, handed "
        << "in last; the step waits for it)";
    o << "\n";
    if (v.pieces < v.chunks)
      o << "  a smaller zero.reduce_bucket_size makes them final in more pieces: less exposed\n";
  }
  o << "  optimizer step " << secs(v.optimizer_s);
  if (c.zero.stage >= 2 && v.speculative_s > v.optimizer_s)
    o << " (" << secs(v.speculative_s) << " into pending versions: memory-resident state "
      << "updated out of place)";
  if (v.device_share > 0)
    o << " (optimizer.update auto: the GPU takes " << static_cast<int>(100 * v.device_share + 0.5)
      << " % of the memory-resident elements beside the CPU)";
  o << ", exposed after the last gradient " << secs(v.exposed_s);
  if (v.commit_s > 0) o << " (of which the parameters' commit copy " << secs(v.commit_s) << ")";
  o << "\n  at least: not counted are the hand-ins' copies during the backward, the last bucket's "
    << "reduction and the decision\n"
    << "  backward + step " << secs(v.backward_and_step_s) << ", serial (backward, then step) "
    << secs(v.serial_s) << "\n";
  if (c.optimizer.overlap == strata::OptimizerOverlap::kOff)
    o << "  note: this config has optimizer.overlap: off; its steps are the serial ones\n";
}

void print_human(std::ostream& o, const strata::ProfileReport& r, const std::string& tuned_path) {
  print_machine(o, r);
  print_nvme(o, r);
  print_copies(o, r);
  print_compute(o, r);
  print_collectives(o, r);
  print_sample_step(o, r);
  print_node_sharing(o, r);
  print_engine_check(o, r);
  print_prediction(o, r);
  print_recommendation(o, r, tuned_path);
}

const bool kRegistered = strata::cli::register_command(
    {"profile", "Measure the configured tiers' links here and predict the step overhead",
     [](CLI::App& cmd) {
       auto o = std::make_shared<Options>();
       cmd.add_option("config", o->config, "YAML config")->required();
       strata::cli::add_set_option(cmd, o->overrides);
       auto* quick =
           cmd.add_flag("--quick", o->quick, "A small subset of the measurements, small sizes");
       auto* full =
           cmd.add_flag("--full", o->full, "Every block size, queue depth, ring count and size");
       auto* tiny = cmd.add_flag("--tiny", o->tiny, "Tiny sizes (tests)")->group("");
       quick->excludes(full)->excludes(tiny);
       full->excludes(tiny);
       cmd.add_flag("--json", o->json, "Print one JSON document with every measurement");
       cmd.add_option("--write-config", o->write_config,
                      "Write the config with the recommendations applied to this file (the "
                      "original's comments, order and units kept)");
       cmd.add_option("--json-file", o->json_file,
                      "Also write the JSON report to this file (the human report stays on stdout)");
       cmd.add_option("--target-overhead", o->target_overhead,
                      "Target transfer overhead per step in seconds, for the placement")
           ->capture_default_str();
       cmd.add_option("--repeats", o->repeats, "Sample-step repeats (default: per mode)")
           ->check(CLI::Range(1u, 1000000u));
       cmd.add_option("--backward", o->backward,
                      "Also predict the step hidden behind a backward of this many seconds "
                      "(optimizer.overlap): the optimizer time exposed after the last gradient")
           ->check(CLI::NonNegativeNumber);
       return [o]() -> int {
         if (!std::isfinite(o->backward))  // before minutes of measurements
           strata::fail(strata::ErrorCode::kInvalidArgument,
                        strata::strcat("profile: --backward ", o->backward,
                                       ": seconds, a finite number >= 0"));
         const strata::Config config = strata::load_config(o->config, o->overrides);
         if (config.model.parameters == 0)
           strata::fail(strata::ErrorCode::kInvalidArgument,
                        config.source +
                            ": model.parameters: strata profile needs the model's "
                            "parameter count to predict its step (e.g. model: "
                            "{parameters: 7.5B})");
         strata::ProfileOptions po;
         po.mode = o->tiny    ? strata::ProfileMode::kTiny
                   : o->quick ? strata::ProfileMode::kQuick
                   : o->full  ? strata::ProfileMode::kFull
                              : strata::ProfileMode::kDefault;
         po.target_overhead_s = o->target_overhead;
         po.sample_repeats = o->repeats;
         // A multi-process launch (mpirun): one profile per rank, rank 0 reports.
         std::unique_ptr<strata::Communicator> comm;
         const auto backend = config.runtime.communicator;
         if (backend == strata::CommBackend::kMpi ||
             (strata::launched_by_mpi() && backend != strata::CommBackend::kInProcess)) {
           if (!strata::mpi_available())
             strata::fail(strata::ErrorCode::kInvalidArgument,
                          "profile: launched by mpirun (or runtime.communicator: mpi) but this "
                          "build has no MPI");
           comm = strata::make_mpi_communicator(config.runtime.collective_timeout_s);
           po.comm = comm.get();
         }
         const bool lead = !comm || comm->rank() == 0;
         // --write-config: open (and create) the output before minutes of measurements.
         OutputFile out, json_out;
         std::string open_error;
         if (lead) {
           try {
             if (!o->write_config.empty()) out.open(o->write_config, "--write-config");
             if (!o->json_file.empty()) json_out.open(o->json_file, "--json-file");
           } catch (const strata::Error& e) {
             open_error = e.what();
           }
         }
         if (comm) {  // every rank fails together when the lead cannot write
           std::uint32_t mine = open_error.empty() ? 0u : 1u;
           std::vector<std::uint32_t> all(static_cast<std::size_t>(comm->size()));
           comm->all_gather(&mine, all.data(), 1, strata::DType::kFp32);
           if (!lead && all[0] != 0)
             strata::fail(strata::ErrorCode::kInvalidArgument,
                          "profile: rank 0 cannot write its output files");
         }
         if (!open_error.empty()) strata::fail(strata::ErrorCode::kInvalidArgument, open_error);
         const bool tty = ::isatty(2) == 1;
         if (lead) {
           if (tty) {
             po.progress = [](const std::string& line) {
               if (line.rfind("== ", 0) == 0)
                 std::cerr << "\r\033[K" << line << "\n";
               else
                 std::cerr << "\r\033[K  " << line << std::flush;
             };
           } else {  // a pipe, a file, a batch scheduler: whole lines
             po.progress = [](const std::string& line) {
               std::cerr << "strata profile: " << line << std::endl;
             };
           }
         }
         const strata::ProfileReport r = strata::run_profile(config, po);
         if (!lead) return 0;
         if (tty) std::cerr << "\r\033[K" << std::flush;
         std::string note;
         if (out) {
           std::ifstream in(o->config);
           std::string text((std::istreambuf_iterator<char>(in)), {});
           std::string body = strata::tuned_config_text(text, config, r.tuned, o->overrides, &note);
           std::string header = "# Tuned by `strata profile` (" +
                                std::string(strata::profile_mode_name(po.mode)) + " mode) from " +
                                config.source + " on " + r.environment.timestamp_utc + "\n";
           for (const auto& n : r.tuned_notes) header += "#   " + n + "\n";
           if (!note.empty()) header += "#   " + note + "\n";
           out.write(header + body);
         }
         json j = report_json(r);
         std::optional<strata::OverlapPrediction> overlap;
         if (o->backward >= 0) {
           overlap = strata::predict_overlap(r.configured, o->backward,
                                             strata::overlap_shape(config), r.bandwidths);
           j["model"]["overlap"] = overlap_json(*overlap, config);
         }
         j["recommendation"]["tuned_config"] =
             o->write_config.empty() ? json(nullptr) : json(o->write_config);
         if (!note.empty()) j["recommendation"]["tuned_config_note"] = note;
         if (json_out) json_out.write(j.dump(2) + "\n");
         if (o->json) {
           std::cout << j.dump(2) << "\n";
         } else {
           print_human(std::cout, r, o->write_config);
           if (!note.empty()) std::cout << "  note: " << note << "\n";
           if (overlap) print_overlap(std::cout, *overlap, config);
         }
         return 0;
       };
     }});

}  // namespace
}  // namespace cmd_profile
