// `strata import-deepspeed ds_config.json [-o strata.yaml]`: a DeepSpeed config as a strata YAML
// (cli/import_deepspeed.hpp; docs/config.md, "Importing a DeepSpeed config"). The YAML goes to
// stdout, or to -o FILE (created beside it and renamed into place; an existing FILE is kept unless
// --overwrite); every key with no strata meaning and every "auto" resolution is a warning on
// stderr (and a comment at the end of the YAML). Exit 0, or 2 for malformed or invalid input.
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <iostream>
#include <memory>

#include "cli/command.hpp"
#include "cli/import_deepspeed.hpp"
#include "core/file_env.hpp"
#include "core/printable.hpp"
#include "core/safe_fs.hpp"
#include "strata/device_query.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"

namespace cmd_import_deepspeed {
namespace {

using namespace strata;

constexpr std::uint64_t kMaxInput = 1 << 20;

struct Options {
  std::string input;
  std::string output;
  bool overwrite = false;
  std::string parameters, hidden_size, micro_batch;
  std::uint32_t ranks = 0;
  std::string precision;
};

std::string read_input(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw IoError("open", path, 0, 0, errno, "DeepSpeed config");
  UniqueFd guard(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw IoError("stat", path, 0, 0, errno, "DeepSpeed config");
  if (!S_ISREG(st.st_mode)) fail(ErrorCode::kInvalidArgument, strcat(path, ": not a regular file"));
  if (static_cast<std::uint64_t>(st.st_size) > kMaxInput)
    fail(ErrorCode::kInvalidArgument,
         strcat(path, ": ", st.st_size, " bytes; a DeepSpeed config may have at most ", kMaxInput));
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError("read", path, done, text.size() - done, errno, "DeepSpeed config");
    if (n == 0) break;
    done += static_cast<std::size_t>(n);
  }
  text.resize(done);
  return text;
}

// Writes `text` to `path` through a temporary file beside it, renamed onto it (replacing nothing
// unless overwrite, and then only a regular file).
void write_output(const std::string& path, const std::string& text, bool overwrite) {
  ReplacingFile out(path, "-o", overwrite, 0644);
  out.file().write_at(text.data(), text.size(), 0);
  out.commit();
}

// Whether bf16 is supported for fp16/bf16 "auto" (import_deepspeed.hpp): the GPUs this process
// sees, all of compute capability >= 8.0, or none visible.
void bf16_support(cli::DsImportOptions& io) {
  const GpuQuery q = query_cuda_devices();
  for (const GpuInfo& g : q.devices)
    if (g.major < 8) {
      io.bf16_supported = false;
      io.bf16_why = strcat("GPU ", g.index, " (", g.name, ") has compute capability ", g.major, ".",
                           g.minor, ", below 8.0");
      return;
    }
  if (!q.devices.empty())
    io.bf16_why = strcat(q.devices.size(), " GPU(s) here, all of compute capability >= 8.0");
}

int run(const Options& o) {
  cli::DsImportOptions io;
  io.source = o.input;
  auto counted = [](const std::string& flag, const std::string& v) -> std::uint64_t {
    try {
      const std::uint64_t n = parse_count(v);
      if (n == 0) throw Error(ErrorCode::kInvalidArgument, "must be >= 1");
      return n;
    } catch (const Error& e) {
      fail(ErrorCode::kInvalidArgument, strcat(flag, " '", v, "': ", e.what()));
    }
  };
  if (!o.parameters.empty()) io.parameters = counted("--parameters", o.parameters);
  if (!o.hidden_size.empty()) io.hidden_size = counted("--hidden-size", o.hidden_size);
  if (!o.micro_batch.empty())
    io.micro_batch = static_cast<std::uint32_t>(counted("--micro-batch", o.micro_batch));
  if (o.ranks) io.ranks = o.ranks;
  io.precision = o.precision;
  if (o.precision.empty()) bf16_support(io);
  const std::string text = read_input(o.input);
  const cli::DsImportResult r = cli::import_deepspeed(text, io);
  for (const auto& w : r.warnings)
    std::cerr << "strata: warning: " << printable(o.input) << ": " << printable(w) << "\n";
  if (o.output.empty() || o.output == "-") {
    std::cout << r.yaml;
  } else {
    write_output(o.output, r.yaml, o.overwrite);
    std::cerr << "strata: wrote " << o.output << " (" << r.warnings.size()
              << " warning(s)); check it with `strata plan " << o.output << "`\n";
  }
  return 0;
}

const bool kRegistered = strata::cli::register_command(
    {"import-deepspeed", "Convert a DeepSpeed ds_config.json into a strata YAML config",
     [](CLI::App& cmd) {
       auto o = std::make_shared<Options>();
       cmd.add_option("ds_config", o->input, "DeepSpeed JSON config")->required();
       auto* output =
           cmd.add_option("-o,--output", o->output, "Write the YAML here (default: stdout)");
       cmd.add_flag("--overwrite", o->overwrite, "Replace the -o file if it exists")->needs(output);
       cmd.add_option("--parameters", o->parameters,
                      "model.parameters, e.g. 7B (a DeepSpeed config has no model size)");
       cmd.add_option("--hidden-size", o->hidden_size,
                      "Resolves \"auto\" bucket sizes as the HF Trainer does (hidden^2)");
       cmd.add_option("--ranks", o->ranks, "world.ranks (default: derived from the batch sizes)")
           ->check(CLI::Range(1, 1 << 20));
       cmd.add_option("--micro-batch", o->micro_batch,
                      "Resolves \"auto\" train_micro_batch_size_per_gpu");
       cmd.add_option("--precision", o->precision,
                      "Resolves fp16/bf16 \"enabled\": \"auto\" (fp16, bf16, fp32); default: bf16 "
                      "when bf16.enabled is \"auto\" and bf16 is supported (every GPU here of "
                      "compute capability >= 8.0, or none visible), else fp16 when fp16.enabled is "
                      "\"auto\", else fp32")
           ->check(CLI::IsMember({"fp16", "bf16", "fp32"}));
       return [o]() -> int { return run(*o); };
     }});

}  // namespace
}  // namespace cmd_import_deepspeed
