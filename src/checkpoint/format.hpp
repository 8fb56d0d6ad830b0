// The on-disk format of strata checkpoints, version 2 (docs/offload.md, "Checkpoint format"):
// the manifest (parse, validate, seal), the shard layout and header, and block-verified reads.
// Shared by Engine checkpoints (checkpoint/checkpoint.cpp) and `strata checkpoint
// info|verify|export`.
//
// A checkpoint directory holds
//   manifest.json                the checkpoint: format version, strata version, serial, world,
//                                stage, parameter dtype, flat layout (every tensor's name, element
//                                count and flat offset), step counters, loss scale, the config,
//                                and per shard its file, size, element range and header CRC32C.
//                                Sealed: its last member is "manifest_crc32c", the CRC32C of every
//                                byte before the ",\n" that precedes it (so any change fails).
//   extra-<serial>.bin           optional (written by rank 0 when the embedder gave tensors it
//                                does not train: frozen parameters, buffers): their bytes one
//                                after another, each tensor's CRC32C in the manifest.
//   shard-<serial>-r<rank>.bin   one per saving rank, holding the flat element range
//                                [rank * partition_size, +partition_size) (rank r's ZeRO partition
//                                at stages 1-3; the same slice of the replicated state at stage 0):
//                                header | params (model dtype) | master | exp_avg | exp_avg_sq.
// The header (a multiple of 4096 bytes) repeats the shard's identity and holds a CRC32C per block
// of block_elems elements of each of the four sections (a section's last block's CRC also covers
// the zero padding after it, so every byte of the file is checksummed); the manifest holds the
// header's CRC32C.
// So a reader that needs some elements of a shard reads the header (verified against the
// manifest), then only the blocks holding those elements, each verified against the header.
// All integers little-endian. Sections start at multiples of 4096.
//
// Failures (every one a strata::Error naming the file, and the field or section):
//   kChecksum        a damaged manifest (checksum, truncation), a damaged shard (size, header,
//                    block CRC), a missing shard file (corrupt checkpoint);
//   kInvalidArgument a manifest whose checksum holds but a field is wrong or inconsistent, a
//                    format this strata does not read (newer, older, not a strata checkpoint);
//   IoError          the directory or manifest cannot be opened (ENOENT: no checkpoint there),
//                    a read fails.
// Thread-safety: plain values and functions; a ShardReader is used by one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/file_env.hpp"
#include "core/safe_fs.hpp"
#include "strata/checkpoint_model.hpp"
#include "strata/config.hpp"

namespace strata::checkpoint {

using strata::SafeDir;
using strata::SafeDirOptions;
using strata::UniqueFd;

inline constexpr std::uint32_t kFormatVersion = 2;
inline constexpr const char* kFormatName = "strata-checkpoint";
inline constexpr const char* kManifestName = "manifest.json";
inline constexpr const char* kManifestTmpName = "manifest.json.tmp";
inline constexpr std::uint64_t kDefaultBlockElems = 1u << 18;  // 1 MiB of FP32 per block
// The largest block a checkpoint may have (16 MiB of FP32): save_checkpoint writes no larger one,
// parse_manifest refuses one (what a reader holds in memory is a few blocks).
inline constexpr std::uint64_t kMaxBlockElems = 1u << 22;
inline constexpr std::uint64_t kMaxManifestBytes = 64ull << 20;
// JSON values (objects, arrays, strings, keys, numbers) a manifest may hold: 4 per tensor, so
// about a million tensors.
inline constexpr std::size_t kMaxManifestValues = 1u << 22;
inline constexpr std::uint64_t kMaxHeaderBytes = 64ull << 20;
inline constexpr int kMaxWorld = 1 << 20;
inline constexpr int kSections = 4;
inline constexpr const char* kSectionNames[kSections] = {"params", "master", "exp_avg",
                                                         "exp_avg_sq"};
enum Section { kParams = 0, kMaster = 1, kExpAvg = 2, kExpAvgSq = 3 };

struct TensorEntry {
  std::string name;
  std::uint64_t numel = 0;
  std::uint64_t offset = 0;  // flat offset (saved layout)
  // Optional (absent from manifests written before them, and when the embedder gave none).
  bool has_shape = false;
  std::vector<std::uint64_t> shape;  // the model's shape (product == numel; empty: a scalar)
  std::vector<std::string> aliases;  // further model names of the tensor (tied weights)
};

// A tensor the engine does not train, in the checkpoint's extra file (strata/checkpoint_model.hpp).
struct ExtraEntry {
  std::string name;
  std::string dtype;  // safetensors' name (extra_dtype_size)
  std::vector<std::uint64_t> shape;
  std::uint64_t offset = 0, bytes = 0;  // in the extra file; bytes == numel x element size
  std::uint32_t crc32c = 0;             // of those bytes
};
inline constexpr std::size_t kMaxShapeDims = 64;
// Bytes per element of an extra tensor's dtype ("F32", "I64", ...); 0 for a name not known.
std::uint64_t extra_dtype_size(std::string_view dtype);
// The element count of `shape`, or Error(kInvalidArgument) naming `what` beyond kMaxElems.
std::uint64_t shape_numel(const std::vector<std::uint64_t>& shape, const std::string& what);

struct ShardEntry {
  int rank = 0;
  std::string file;         // shard-<serial>-r<rank>.bin
  std::uint64_t bytes = 0;  // file size
  std::uint64_t begin = 0;  // flat range [begin, begin + count)
  std::uint64_t count = 0;
  std::uint32_t header_crc32c = 0;
};

// A parameter group's hyper-parameters at the save (Engine's ParamGroupOptions).
struct GroupEntry {
  double lr = 0, weight_decay = 0, beta1 = 0, beta2 = 0, eps = 0;
};
inline constexpr std::size_t kMaxGroups = 1u << 16;
// The embedder's own state saved with a checkpoint (UTF-8 text, e.g. JSON: a loop's step, data
// position, scheduler state).
inline constexpr std::size_t kMaxClientStateBytes = 1u << 20;

// The training counters a checkpoint carries, saved from the rank (RankState) into the Manifest
// and loaded back: both derive from this one list of them.
struct TrainingCounters {
  std::int64_t adam_step = 0;
  // Each tensor's own Adam step count (its "step" in `tensors`), when they differ from adam_step
  // (a tensor skipped by some update); empty: every tensor's is adam_step.
  std::vector<std::int64_t> tensor_steps;
  double loss_scale = 1;
  std::uint32_t good_steps = 0;
  std::uint64_t steps = 0, applied_steps = 0, skipped_steps = 0;
  // Per parameter group, in group order (optional: absent from manifests written before them;
  // a load may find it empty).
  std::vector<GroupEntry> groups;
  std::string client_state;  // the embedder's (rank 0's is saved)
};

struct Manifest : TrainingCounters {
  std::uint32_t format_version = kFormatVersion;
  std::string strata_version;
  std::uint64_t serial = 0;
  int world = 1;
  int stage = 0;
  DType param_dtype = DType::kFp32;
  std::uint64_t flat_size = 0;
  std::uint64_t partition_size = 0;
  std::uint64_t block_elems = kDefaultBlockElems;
  std::vector<TensorEntry> tensors;
  std::string config_yaml;
  // Optional (absent from manifests written before them: empty).
  std::string extra_file;          // "" (none) or extra-<serial>.bin
  std::uint64_t extra_bytes = 0;   // its size
  std::vector<ExtraEntry> extra;   // its tensors, back to back from offset 0
  std::vector<ShardEntry> shards;  // shards[r].rank == r
  // Set by parse_manifest: where it came from and its own checksum.
  std::string path;
  std::uint32_t crc32c = 0;
};

// Whether `s` is valid UTF-8 (what the manifest's strings must be).
bool valid_utf8(std::string_view s);

std::string shard_file_name(std::uint64_t serial, int rank);
// Parses "shard-<serial>-r<rank>.bin"; false for any other name.
bool parse_shard_file_name(std::string_view name, std::uint64_t* serial, int* rank);
std::string extra_file_name(std::uint64_t serial);
// Parses "extra-<serial>.bin"; false for any other name.
bool parse_extra_file_name(std::string_view name, std::uint64_t* serial);
// The serial of a checkpoint file (a shard or an extra file); false for any other name.
bool checkpoint_file_serial(std::string_view name, std::uint64_t* serial);

// Records the embedder's model description in `m` (whose tensors are set): each tensor's shape
// and aliases, the extra tensors (laid out back to back in extra_file_name(m.serial); their
// CRC32C computed when `crcs`). Checks what strata/checkpoint_model.hpp says, then the names
// (check_model_names): Error(kInvalidArgument), `m` unusable.
void set_model(Manifest& m, const CheckpointModel& model, bool crcs);
// Every name an export writes (tensor names, aliases, extra tensors) is non-empty, not
// "__metadata__" and unique; else Error(kInvalidArgument) naming it and `m.path`.
void check_model_names(const Manifest& m);

// Sealed JSON text (see above). Tensor names must be valid UTF-8 (Error kInvalidArgument).
std::string serialize_manifest(const Manifest& m);
// The manifest's fields as manifest.json holds them, without the seal: what serialize_manifest
// seals and what `strata checkpoint info --json` shows (one list of fields for both).
nlohmann::json manifest_fields(const Manifest& m);
// Checks the seal, the format and version, then every field (types, ranges, consistency: the
// shards tile [0, flat_size) in partitions, tensors ascending and inside it, file names as
// written). `path` is for messages.
Manifest parse_manifest(std::string_view text, const std::string& path);
// Opens DIR/manifest.json (no symlink, a regular file of at most kMaxManifestBytes) and parses it.
// Through `env` (FileEnv::current() by default), as every file of a checkpoint is read and written.
Manifest read_manifest(const SafeDir& dir, FileEnv& env = FileEnv::current());

// The manifest's extra file (m.extra_file non-empty), opened (no symlink) and checked: a regular
// file of m.extra_bytes bytes, else Error(kChecksum) (missing: the checkpoint is incomplete).
std::unique_ptr<RandomAccessFile> open_extra_file(const SafeDir& dir, const Manifest& m,
                                                  FileEnv& env = FileEnv::current());
// Streams extra tensor i of `m` from `file` through `sink` in pieces of at most kExtraPiece bytes,
// then checks its CRC32C: Error(kChecksum) naming the file, tensor, offset and length (what the
// sink received is then not to be used).
inline constexpr std::uint64_t kExtraPiece = 1ull << 20;
void read_extra_tensor(RandomAccessFile& file, const Manifest& m, std::size_t i,
                       const std::function<void(const unsigned char*, std::uint64_t)>& sink);

// The header and each section of a shard start at a multiple of this, the gaps zero.
inline constexpr std::uint64_t kSectionAlign = 4096;

// Where a shard's parts lie.
struct ShardLayout {
  std::uint64_t nblocks = 0;       // blocks per section: ceil(count / block_elems)
  std::uint64_t header_bytes = 0;  // multiple of 4096
  std::uint64_t elem_bytes[kSections] = {};
  std::uint64_t offset[kSections] = {};
  std::uint64_t bytes[kSections] = {};   // data
  std::uint64_t padded[kSections] = {};  // data + the zero padding up to the next section / the end
  std::uint64_t total = 0;               // file size
};
// Throws Error(kInvalidArgument) when the header would exceed kMaxHeaderBytes.
ShardLayout shard_layout(std::uint64_t count, DType param_dtype, std::uint64_t block_elems);

// The shard header: identity fields and the block CRC tables (crcs[section][block]).
std::vector<unsigned char> encode_shard_header(const Manifest& m, int rank, const ShardLayout& l,
                                               const std::vector<std::uint32_t> (&crcs)[kSections]);

// Reads (parts of) one shard, verifying as it goes. Construction opens the file (no symlink),
// checks its size against the manifest, reads the header, checks its CRC32C against the
// manifest and its fields against the manifest's entry. read() and verify() check the CRC32C of
// every block they touch against the header. read() keeps the last run of blocks it read per
// section so that neighbouring requests do not read a block twice (memory: at most kCacheBlocks
// blocks and kCacheBytes per section, one block at least); verify() streams each block through a
// buffer of at most kVerifyPiece bytes, whatever the block size (memory: the header's CRC tables,
// at most kMaxHeaderBytes, plus kVerifyPiece).
class ShardReader {
 public:
  static constexpr std::uint64_t kCacheBlocks = 4;
  static constexpr std::uint64_t kCacheBytes = 4ull << 20;
  static constexpr std::uint64_t kVerifyPiece = 1ull << 20;
  ShardReader(const SafeDir& dir, const Manifest& m, int shard, FileEnv& env = FileEnv::current());
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  const ShardLayout& layout() const { return layout_; }
  const std::string& path() const { return path_; }
  // Elements [first, first + n) of `section` (relative to the shard's begin) into dst.
  void read(Section section, std::uint64_t first, std::uint64_t n, void* dst);
  // Verifies the blocks holding elements [first, first + n) of `section` (no copy); a block
  // verify() already checked is not read again (many small tensors share a block).
  void verify(Section section, std::uint64_t first, std::uint64_t n);
  std::uint64_t bytes_read() const { return bytes_read_; }
  void drop_cache() {
    for (auto& c : cache_) c = Cache{};
  }

 private:
  void load_blocks(Section s, std::uint64_t b0, std::uint64_t b1);
  void check_range(std::uint64_t first, std::uint64_t n) const;
  void check_block_crc(Section s, std::uint64_t b, std::uint64_t offset, std::uint64_t len,
                       std::uint32_t crc) const;
  const Manifest& m_;
  int shard_;
  std::string path_;
  std::unique_ptr<RandomAccessFile> file_;
  ShardLayout layout_;
  std::vector<std::uint32_t> crc_[kSections];
  std::vector<bool> verified_[kSections];  // blocks verify() read and checked
  struct Cache {
    std::vector<unsigned char> buf;
    std::uint64_t b0 = 0, b1 = 0;  // blocks [b0, b1) in buf
  } cache_[kSections];
  std::uint64_t bytes_read_ = 0;
};

}  // namespace strata::checkpoint
