// Two-layer MLP, FP32 forward and backward (see mlp_model.hpp).
#include "cli/mlp_model.hpp"

#include <cmath>
#include <random>

#include "strata/error.hpp"

namespace strata::cli {

MlpModel::MlpModel(MlpShape shape, std::uint64_t seed) : shape_(shape), seed_(seed) {
  if (shape.input == 0 || shape.hidden == 0 || shape.output == 0)
    fail(ErrorCode::kInvalidArgument, "mlp: every layer needs at least one unit");
  // The teacher: a different random MLP of the same shape, with larger weights.
  std::mt19937_64 rng(seed ^ 0x7eac4e5ull);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (std::size_t i = 0; i < kTensors; ++i) {
    std::vector<float> t(tensor_numel(i));
    for (auto& v : t)
      v = d(rng) / std::sqrt(static_cast<float>(i < 2 ? shape_.input : shape_.hidden));
    teacher_.push_back(std::move(t));
  }
}

std::string MlpModel::tensor_name(std::size_t i) const {
  static const char* kNames[kTensors] = {"w1", "b1", "w2", "b2"};
  return kNames[i];
}

std::size_t MlpModel::tensor_numel(std::size_t i) const {
  switch (i) {
    case 0: return shape_.hidden * shape_.input;
    case 1: return shape_.hidden;
    case 2: return shape_.output * shape_.hidden;
    case 3: return shape_.output;
  }
  fail(ErrorCode::kInvalidArgument, strcat("mlp: tensor ", i));
}

std::size_t MlpModel::parameters() const {
  std::size_t n = 0;
  for (std::size_t i = 0; i < kTensors; ++i) n += tensor_numel(i);
  return n;
}

std::vector<float> MlpModel::initial(std::size_t i) const {
  std::vector<float> t(tensor_numel(i), 0.0f);
  if (i == 1 || i == 3) return t;
  const float fan_in = static_cast<float>(i == 0 ? shape_.input : shape_.hidden);
  const float fan_out = static_cast<float>(i == 0 ? shape_.hidden : shape_.output);
  const float limit = std::sqrt(6.0f / (fan_in + fan_out));
  std::mt19937_64 rng(seed_ * 31 + i);
  std::uniform_real_distribution<float> d(-limit, limit);
  for (auto& v : t) v = d(rng);
  return t;
}

namespace {
// y = W2 tanh(W1 x + b1) + b2 for one sample; h receives the hidden activations.
void mlp_forward(const MlpShape& s, const std::vector<std::vector<float>>& p, const float* x,
                 float* h, float* y) {
  for (std::size_t j = 0; j < s.hidden; ++j) {
    float a = p[1][j];
    for (std::size_t k = 0; k < s.input; ++k) a += p[0][j * s.input + k] * x[k];
    h[j] = std::tanh(a);
  }
  for (std::size_t o = 0; o < s.output; ++o) {
    float a = p[3][o];
    for (std::size_t j = 0; j < s.hidden; ++j) a += p[2][o * s.hidden + j] * h[j];
    y[o] = a;
  }
}
}  // namespace

void MlpModel::make_batch(int rank, std::uint64_t step, std::size_t batch, std::uint64_t micro) {
  batch_ = batch;
  std::mt19937_64 rng(seed_ ^ (step * 0x9e3779b97f4a7c15ull) ^
                      (static_cast<std::uint64_t>(rank) << 48) ^ (micro * 0xbf58476d1ce4e5b9ull));
  std::normal_distribution<float> d(0.0f, 1.0f);
  x_.resize(batch * shape_.input);
  y_.resize(batch * shape_.output);
  std::vector<float> h(shape_.hidden);
  for (auto& v : x_) v = d(rng);
  for (std::size_t b = 0; b < batch; ++b) {
    mlp_forward(shape_, teacher_, &x_[b * shape_.input], h.data(), &y_[b * shape_.output]);
    for (std::size_t o = 0; o < shape_.output; ++o) y_[b * shape_.output + o] += 0.01f * d(rng);
  }
}

double MlpModel::forward_backward(const std::vector<std::vector<float>>& p,
                                  std::vector<std::vector<float>>& g) {
  const MlpShape& s = shape_;
  g.resize(kTensors);
  for (std::size_t i = 0; i < kTensors; ++i) g[i].assign(tensor_numel(i), 0.0f);
  std::vector<float> h(s.hidden), y(s.output), dy(s.output), dh(s.hidden);
  double loss = 0;
  const float inv = 1.0f / static_cast<float>(batch_ * s.output);
  for (std::size_t b = 0; b < batch_; ++b) {
    const float* x = &x_[b * s.input];
    mlp_forward(s, p, x, h.data(), y.data());
    for (std::size_t o = 0; o < s.output; ++o) {
      float e = y[o] - y_[b * s.output + o];
      loss += static_cast<double>(e) * e;
      dy[o] = 2.0f * e * inv;
      g[3][o] += dy[o];
    }
    for (std::size_t j = 0; j < s.hidden; ++j) {
      float acc = 0;
      for (std::size_t o = 0; o < s.output; ++o) {
        g[2][o * s.hidden + j] += dy[o] * h[j];
        acc += p[2][o * s.hidden + j] * dy[o];
      }
      dh[j] = acc * (1.0f - h[j] * h[j]);
      g[1][j] += dh[j];
      for (std::size_t k = 0; k < s.input; ++k) g[0][j * s.input + k] += dh[j] * x[k];
    }
  }
  return loss / static_cast<double>(batch_ * s.output);
}

}  // namespace strata::cli
