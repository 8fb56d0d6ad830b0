// The small model `strata train` trains through the Engine: a two-layer MLP (tanh hidden layer)
// on a synthetic regression task (targets from a fixed random "teacher" MLP plus noise), with
// its own FP32 forward and backward. Each rank draws its own batches (data parallel).
//
// Thread-safety: an MlpModel is used by one thread. Not a general-purpose layer library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace strata::cli {

struct MlpShape {
  std::size_t input = 16;
  std::size_t hidden = 64;
  std::size_t output = 4;
};

class MlpModel {
 public:
  // Tensor order: w1 [hidden x input], b1 [hidden], w2 [output x hidden], b2 [output].
  static constexpr std::size_t kTensors = 4;

  MlpModel(MlpShape shape, std::uint64_t seed);
  const MlpShape& shape() const { return shape_; }
  std::string tensor_name(std::size_t i) const;
  std::size_t tensor_numel(std::size_t i) const;
  std::size_t parameters() const;
  // Initial values (Xavier-uniform weights, zero biases), the same for a given seed.
  std::vector<float> initial(std::size_t i) const;

  // One batch for (rank, step, micro-batch): inputs and teacher targets.
  void make_batch(int rank, std::uint64_t step, std::size_t batch, std::uint64_t micro = 0);

  // Mean squared error of the batch with parameters `params[i]` (FP32, tensor order); fills
  // grads[i] with d loss / d params[i]. Returns the loss.
  double forward_backward(const std::vector<std::vector<float>>& params,
                          std::vector<std::vector<float>>& grads);

 private:
  MlpShape shape_;
  std::uint64_t seed_;
  std::vector<std::vector<float>> teacher_;
  std::vector<float> x_, y_;
  std::size_t batch_ = 0;
};

}  // namespace strata::cli
