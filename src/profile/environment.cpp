// The machine a profile ran on: kernel, CPU, memory, GPU, and the file system and block device
// under each NVMe path (from /proc/self/mountinfo).
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "profile/profile_internal.hpp"
#include "strata/device_query.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"

namespace strata::profile {
namespace {

std::string read_first_line(const std::string& file) {
  std::ifstream in(file);
  std::string line;
  std::getline(in, line);
  return line;
}

// mountinfo escapes spaces etc. as \040.
std::string unescape(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
      out += static_cast<char>(std::stoi(s.substr(i + 1, 3), nullptr, 8));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

}  // namespace

PathInfo describe_path(const std::string& path) {
  PathInfo info;
  info.path = path;
  std::error_code ec;
  const std::string canon = std::filesystem::weakly_canonical(path, ec).string();
  const std::string target = ec ? path : canon;
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  std::size_t best = 0;
  while (std::getline(in, line)) {
    // id parent major:minor root mount_point options [optional...] - fstype source super
    std::istringstream ls(line);
    std::string id, parent, devno, root, mount_point, options, tok;
    ls >> id >> parent >> devno >> root >> mount_point >> options;
    while (ls >> tok && tok != "-") {
    }
    std::string fstype, source;
    ls >> fstype >> source;
    mount_point = unescape(mount_point);
    const bool prefix =
        target == mount_point || (target.rfind(mount_point, 0) == 0 &&
                                  (mount_point == "/" || target[mount_point.size()] == '/'));
    if (prefix && mount_point.size() >= best) {
      best = mount_point.size();
      info.mount_point = mount_point;
      info.filesystem = fstype;
      info.device = unescape(source);
    }
  }
  struct statvfs vfs {};
  if (::statvfs(path.c_str(), &vfs) == 0)
    info.free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  return info;
}

Environment collect_environment(const std::vector<std::string>& paths,
                                const std::string& adam_path) {
  Environment e;
  struct utsname u {};
  if (::uname(&u) == 0) {
    e.kernel = std::string(u.sysname) + " " + u.release + " " + u.machine;
    e.hostname = u.nodename;
  }
  {
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("model name", 0) == 0) {
        auto pos = line.find(':');
        if (pos != std::string::npos) e.cpu_model = line.substr(pos + 2);
        break;
      }
    }
  }
  e.cores = std::max(1u, std::thread::hardware_concurrency());
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) e.memory_bytes = static_cast<std::uint64_t>(pages) * page;
  e.memlock_limit_bytes = page_lock_limit().bytes;  // ~0: unlimited, or CAP_IPC_LOCK lifts it
  const GpuQuery q = query_cuda_devices();
  e.has_gpu = !q.devices.empty();
  if (e.has_gpu) {
    for (const auto& d : q.devices) {
      if (!e.gpu.empty()) e.gpu += ", ";
      e.gpu += strcat("cuda:", d.index, " ", d.name, " (", format_bytes(d.total_memory, true),
                      ", sm_", d.major, d.minor, ")");
    }
  } else {
    e.gpu = q.status;  // "no GPU: <why>"
  }
  e.adam_path = adam_path;
  {
    std::istringstream ls(read_first_line("/proc/loadavg"));
    ls >> e.load_average_1m;
  }
  for (const auto& p : paths) e.paths.push_back(describe_path(p));
  std::time_t now = std::time(nullptr);
  char buf[32];
  std::tm tm{};
  gmtime_r(&now, &tm);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  e.timestamp_utc = buf;
  return e;
}

}  // namespace strata::profile
