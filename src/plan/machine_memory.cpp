// read_machine_memory(): the memory a plan without tiers.host.budget checks against — MemTotal,
// or the memory limit of this process's cgroup where one is set below it (a container, a Slurm
// job, a systemd unit: the kernel kills the process past that limit, whatever MemTotal says).
#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>
#include <vector>

#include "strata/plan.hpp"
#include "strata/units.hpp"

namespace strata {
namespace {

// A limit this large is "no limit" (cgroup v1 writes PAGE_COUNTER_MAX pages, about 2^63).
constexpr std::uint64_t kNoLimit = std::uint64_t{1} << 60;
constexpr std::size_t kMaxLines = 4096;  // bounded reads of the proc files

struct CgroupMount {
  std::string root, point;  // the hierarchy's directory mounted, and where
  bool v2 = false;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string part;
  std::istringstream in(s);
  while (std::getline(in, part, sep)) out.push_back(part);
  return out;
}

bool has_item(const std::string& list, const std::string& item) {
  const auto items = split(list, ',');
  return std::find(items.begin(), items.end(), item) != items.end();
}

// A mountinfo path field as a path: the kernel writes space, tab, newline and backslash as
// three-digit octal escapes ("/mnt/my\040disk").
std::string unescape_mount_field(const std::string& f) {
  std::string out;
  for (std::size_t i = 0; i < f.size(); ++i) {
    const bool octal = f[i] == '\\' && i + 3 < f.size() &&
                       std::all_of(f.begin() + i + 1, f.begin() + i + 4,
                                   [](char c) { return c >= '0' && c <= '7'; });
    if (!octal) {
      out += f[i];
      continue;
    }
    out += static_cast<char>((f[i + 1] - '0') * 64 + (f[i + 2] - '0') * 8 + (f[i + 3] - '0'));
    i += 3;
  }
  return out;
}

// The cgroup2 mount and the cgroup (v1) mount holding the memory controller, from mountinfo
// ("36 35 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw").
void find_mounts(const std::string& mountinfo, CgroupMount* v1, CgroupMount* v2) {
  std::ifstream in(mountinfo);
  std::string line;
  for (std::size_t n = 0; n < kMaxLines && std::getline(in, line); ++n) {
    const auto dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    const auto pre = split(line.substr(0, dash), ' ');
    const auto post = split(line.substr(dash + 3), ' ');
    if (pre.size() < 5 || post.size() < 3) continue;
    const std::string root = unescape_mount_field(pre[3]), point = unescape_mount_field(pre[4]);
    if (post[0] == "cgroup2" && v2->point.empty()) {
      *v2 = {root, point, true};
    } else if (post[0] == "cgroup" && has_item(post[2], "memory") && v1->point.empty()) {
      *v1 = {root, point, false};
    }
  }
}

// The directory of cgroup `path` under mount `m` (the mount shows the hierarchy from m.root).
std::string cgroup_dir(const CgroupMount& m, const std::string& path) {
  if (m.root == "/") return m.point + (path == "/" ? "" : path);
  if (path.rfind(m.root, 0) == 0) return m.point + path.substr(m.root.size());
  return m.point;  // a path outside what is mounted (a namespace's view): its top
}

// One limit file: bytes, kNoLimit for "max" or an unlimited value; false where unreadable.
bool read_limit(const std::string& file, std::uint64_t* bytes) {
  std::ifstream in(file);
  std::string word;
  if (!(in >> word)) return false;
  if (word == "max") {
    *bytes = kNoLimit;
    return true;
  }
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), v);
  if (ec == std::errc::result_out_of_range && end == word.data() + word.size()) {
    *bytes = kNoLimit;  // digits beyond 64 bits: no limit
    return true;
  }
  if (ec != std::errc() || end != word.data() + word.size()) return false;
  *bytes = v >= kNoLimit ? kNoLimit : v;
  return true;
}

// The lowest limit from `dir` up to the mount point (a parent's limit binds its children).
struct Limit {
  std::uint64_t bytes = kNoLimit;
  std::string file;  // where the lowest was read
  std::string unreadable;
};
Limit lowest_limit(const CgroupMount& m, std::string dir) {
  Limit l;
  const char* name = m.v2 ? "/memory.max" : "/memory.limit_in_bytes";
  for (int depth = 0; depth < 64; ++depth) {
    std::uint64_t b = 0;
    const std::string file = dir + name;
    if (read_limit(file, &b)) {
      if (b < l.bytes) l = {b, file, l.unreadable};
    } else if (depth == 0 && std::ifstream(file)) {
      l.unreadable = file;
    }
    if (dir.size() <= m.point.size()) break;
    dir = dir.substr(0, dir.rfind('/'));
  }
  return l;
}

// This process's memory cgroup limit (the lowest of v2 and v1 where both appear).
Limit cgroup_limit(const std::string& proc_cgroup, const std::string& mountinfo) {
  CgroupMount v1, v2;
  find_mounts(mountinfo, &v1, &v2);
  std::ifstream in(proc_cgroup);
  std::string line;
  Limit best;
  for (std::size_t n = 0; n < kMaxLines && std::getline(in, line); ++n) {
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    const CgroupMount* m = nullptr;
    if (controllers.empty() && line.substr(0, a) == "0" && !v2.point.empty()) m = &v2;
    if (has_item(controllers, "memory") && !v1.point.empty()) m = &v1;
    if (!m || path.empty() || path[0] != '/') continue;
    const Limit l = lowest_limit(*m, cgroup_dir(*m, path));
    if (l.bytes < best.bytes) best = l;
    if (best.unreadable.empty()) best.unreadable = l.unreadable;
  }
  return best;
}

MachineMemory read_mem_total(const std::string& meminfo) {
  MachineMemory m;
  std::ifstream in(meminfo);
  if (!in) {
    m.source = "cannot open " + meminfo;
    return m;
  }
  std::string line;
  for (std::size_t n = 0; n < kMaxLines && std::getline(in, line); ++n) {
    if (line.rfind("MemTotal:", 0) != 0) continue;
    std::istringstream fields(line.substr(9));
    std::uint64_t kib = 0;
    std::string unit;
    if (fields >> kib >> unit && unit == "kB" && kib > 0 && kib < (std::uint64_t{1} << 54)) {
      m.known = true;
      m.total = kib * 1024;
      m.source = "MemTotal in " + meminfo;
    } else {
      m.source = "unreadable MemTotal line in " + meminfo + ": '" + line + "'";
    }
    return m;
  }
  m.source = "no MemTotal line in " + meminfo;
  return m;
}

}  // namespace

MachineMemory read_machine_memory(const std::string& meminfo, const std::string& proc_cgroup,
                                  const std::string& mountinfo) {
  MachineMemory m = read_mem_total(meminfo);
  const Limit l = cgroup_limit(proc_cgroup, mountinfo);
  if (l.bytes < kNoLimit && (!m.known || l.bytes < m.total)) {
    m.source = "the memory limit of this process's cgroup, " + l.file +
               (m.known ? ", below MemTotal's " + format_bytes(m.total, true) : "");
    m.known = true;
    m.total = l.bytes;
  } else if (!l.unreadable.empty()) {
    m.source += " (the cgroup limit in " + l.unreadable + " could not be read)";
  }
  return m;
}

}  // namespace strata
