// `strata info`: what this build has (CUDA, NCCL, MPI, sanitizers), as text or JSON.
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/command.hpp"
#include "strata/build_info.hpp"
#include "strata/device_query.hpp"

namespace {
const bool kRegistered = strata::cli::register_command(
    {"info", "Show what this build of strata supports and which GPUs it sees", [](CLI::App& cmd) {
       auto json = std::make_shared<bool>(false);
       cmd.add_flag("--json", *json, "Print one JSON document");
       return [json]() -> int {
         namespace b = strata::build;
         auto gpus = strata::query_cuda_devices();
         if (*json) {
           nlohmann::json j;
           j["version"] = b::kVersion;
           j["cuda"] = b::kWithCuda;
           j["nccl"] = b::kWithNccl;
           j["mpi"] = b::kWithMpi;
           j["cuda_architectures"] = b::kCudaArchitectures;
           j["build_type"] = b::kBuildType;
           j["sanitize"] = b::kSanitize;
           j["compiler"] = b::kCompiler;
           j["gpus"] = nlohmann::json::array();
           for (auto& g : gpus.devices)
             j["gpus"].push_back({{"index", g.index}, {"name", g.name},
                                  {"total_memory_bytes", g.total_memory},
                                  {"compute_capability", std::to_string(g.major) + "." + std::to_string(g.minor)}});
           j["gpu_status"] = gpus.status;
           std::cout << j.dump(2) << "\n";
           return 0;
         }
         std::cout << "strata " << b::kVersion << "\n"
                   << "  CUDA:     " << (b::kWithCuda ? "yes" : "no") << " (architectures "
                   << (b::kWithCuda ? b::kCudaArchitectures : "-") << ")\n"
                   << "  NCCL:     " << (b::kWithNccl ? "yes" : "no") << "\n"
                   << "  MPI:      " << (b::kWithMpi ? "yes" : "no") << "\n"
                   << "  build:    " << b::kBuildType << ", " << b::kCompiler
                   << (b::kSanitize[0] ? std::string(", sanitize=") + b::kSanitize : "") << "\n"
                   << "  GPUs:     " << gpus.status << "\n";
         for (auto& g : gpus.devices)
           std::cout << "    [" << g.index << "] " << g.name << ", " << g.total_memory / (1 << 20)
                     << " MiB, sm_" << g.major << g.minor << "\n";
         return 0;
       };
     }});
}  // namespace
