// Partition: the flat, padded layout of the parameters and its per-rank partitions.
#include "strata/partition.hpp"

#include <algorithm>

#include "core/checked_math.hpp"
#include "strata/error.hpp"

namespace strata {

Partition::Partition(std::vector<TensorSpec> tensors, int world, std::size_t sub_group_size,
                     std::size_t tensor_align, std::size_t partition_align)
    : tensors_(std::move(tensors)), world_(world), sub_group_size_(sub_group_size) {
  if (world < 1) fail(ErrorCode::kInvalidArgument, strcat("partition: world size ", world, " < 1"));
  if (sub_group_size == 0 || tensor_align == 0 || partition_align == 0)
    fail(ErrorCode::kInvalidArgument, "partition: sub_group_size and alignments must be >= 1");
  std::size_t off = 0;
  offsets_.reserve(tensors_.size());
  for (const auto& t : tensors_) {
    off = round_up(off, tensor_align);
    offsets_.push_back(off);
    off += t.numel;
    numel_ += t.numel;
  }
  const auto w = static_cast<std::size_t>(world);
  partition_size_ = round_up((off + w - 1) / w, partition_align);
  if (partition_size_ == 0) partition_size_ = partition_align;  // no parameters at all
}

std::size_t Partition::partition_begin(int rank) const {
  if (rank < 0 || rank >= world_)
    fail(ErrorCode::kInvalidArgument, strcat("partition: rank ", rank, " of ", world_));
  return static_cast<std::size_t>(rank) * partition_size_;
}

int Partition::owner(std::size_t flat_offset) const {
  if (flat_offset >= flat_size())
    fail(ErrorCode::kInvalidArgument,
         strcat("partition: offset ", flat_offset, " >= ", flat_size()));
  return static_cast<int>(flat_offset / partition_size_);
}

std::vector<TensorSlice> Partition::slices(std::size_t tensor) const {
  std::vector<TensorSlice> out;
  const std::size_t begin = offset(tensor), end = begin + tensors_[tensor].numel;
  for (std::size_t pos = begin; pos < end;) {
    const int r = owner(pos);
    const std::size_t pb = partition_begin(r);
    const std::size_t stop = std::min(end, pb + partition_size_);
    out.push_back({tensor, r, pos - begin, pos - pb, stop - pos});
    pos = stop;
  }
  return out;
}

std::vector<TensorSlice> Partition::owned_slices(int rank) const {
  const std::size_t pb = partition_begin(rank), pe = pb + partition_size_;
  std::vector<TensorSlice> out;
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const std::size_t b = std::max(offsets_[i], pb);
    const std::size_t e = std::min(offsets_[i] + tensors_[i].numel, pe);
    if (b < e) out.push_back({i, rank, b - offsets_[i], b - pb, e - b});
  }
  return out;
}

std::vector<Range> Partition::sub_groups(std::size_t begin, std::size_t count) const {
  std::vector<Range> out;
  for (std::size_t pos = 0; pos < count; pos += sub_group_size_)
    out.push_back({begin + pos, std::min(sub_group_size_, count - pos)});
  return out;
}

std::vector<std::size_t> Partition::counts_in(std::size_t begin, std::size_t end) const {
  std::vector<std::size_t> counts(static_cast<std::size_t>(world_), 0);
  for (int r = 0; r < world_; ++r) {
    const std::size_t pb = static_cast<std::size_t>(r) * partition_size_, pe = pb + partition_size_;
    const std::size_t b = std::max(begin, pb), e = std::min(end, pe);
    if (b < e) counts[static_cast<std::size_t>(r)] = e - b;
  }
  return counts;
}

}  // namespace strata
