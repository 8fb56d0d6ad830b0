// ZeRO partitioning: a list of parameter tensors flattened into one contiguous, padded and
// aligned element space, cut into `world` equal partitions (rank r owns
// [r * partition_size, (r + 1) * partition_size)), each partition cut into sub-groups of at most
// `sub_group_size` elements, with the maps between tensors and partitions.
//
// Layout: tensor i starts at offset(i), a multiple of tensor_align elements, right after tensor
// i-1 (the gap is padding); the padded total is rounded up so that partition_size is a multiple
// of partition_align. Padding elements belong to nobody's tensor: the engine keeps them zero.
// Empty tensors (numel 0) are allowed: they occupy no elements and own no slices.
//
// Thread-safety: immutable after construction; share freely. Failure: bad arguments (world < 1,
// zero alignment, rank out of range) throw Error(kInvalidArgument).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace strata {

struct TensorSpec {
  std::string name;
  std::size_t numel = 0;
};

// A piece of one tensor that lies in one rank's partition.
struct TensorSlice {
  std::size_t tensor = 0;            // tensor index
  int rank = 0;                      // owner
  std::size_t tensor_offset = 0;     // first element, within the tensor
  std::size_t partition_offset = 0;  // first element, within the owner's partition
  std::size_t count = 0;
};

// A run of elements inside a partition (or inside any range the caller asked about).
struct Range {
  std::size_t begin = 0;
  std::size_t count = 0;
  std::size_t end() const { return begin + count; }
};

class Partition {
 public:
  static constexpr std::size_t kDefaultTensorAlign = 16;     // 64 B in FP32
  static constexpr std::size_t kDefaultPartitionAlign = 64;  // 256 B in FP32, 128 B in 16-bit

  Partition(std::vector<TensorSpec> tensors, int world, std::size_t sub_group_size,
            std::size_t tensor_align = kDefaultTensorAlign,
            std::size_t partition_align = kDefaultPartitionAlign);

  int world() const { return world_; }
  std::size_t num_tensors() const { return tensors_.size(); }
  const TensorSpec& tensor(std::size_t i) const { return tensors_.at(i); }
  std::size_t offset(std::size_t i) const { return offsets_.at(i); }  // flat offset of tensor i
  std::size_t numel() const { return numel_; }  // sum of tensor sizes, no padding
  std::size_t flat_size() const { return partition_size_ * static_cast<std::size_t>(world_); }
  std::size_t partition_size() const { return partition_size_; }
  std::size_t partition_begin(int rank) const;  // flat offset of rank's partition
  int owner(std::size_t flat_offset) const;     // rank owning a flat element
  std::size_t sub_group_size() const { return sub_group_size_; }

  // Tensor i cut at partition boundaries, in flat order.
  std::vector<TensorSlice> slices(std::size_t tensor) const;
  // Every tensor piece inside rank's partition, in flat order.
  std::vector<TensorSlice> owned_slices(int rank) const;
  // Sub-groups of [begin, begin + count): consecutive runs of at most sub_group_size elements.
  std::vector<Range> sub_groups(std::size_t begin, std::size_t count) const;
  // Sub-groups of a partition (offsets within the partition; the same for every rank).
  std::vector<Range> partition_sub_groups() const { return sub_groups(0, partition_size_); }
  // For the flat range [begin, end): how many of its elements each rank owns (world entries) —
  // the counts of a reduce-scatter / all-gather over that range.
  std::vector<std::size_t> counts_in(std::size_t begin, std::size_t end) const;

 private:
  std::vector<TensorSpec> tensors_;
  std::vector<std::size_t> offsets_;
  int world_;
  std::size_t sub_group_size_;
  std::size_t numel_ = 0;
  std::size_t partition_size_ = 0;
};

}  // namespace strata
