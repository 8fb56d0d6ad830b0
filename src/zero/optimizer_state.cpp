// The host-resident optimizer state store.
#include "zero/optimizer_state.hpp"

#include "strata/error.hpp"

namespace strata::zero {
namespace {

class ResidentStateStore final : public OptimizerStateStore {
 public:
  explicit ResidentStateStore(std::span<const float> init)
      : master_(init.begin(), init.end()), m_(init.size(), 0.0f), v_(init.size(), 0.0f) {}
  std::size_t size() const override { return master_.size(); }
  StateView acquire(Range r) override {
    if (r.end() > master_.size())
      fail(ErrorCode::kInvalidArgument,
           strcat("optimizer state: range [", r.begin, ", ", r.end(), ") beyond ", master_.size()));
    return {master_.data() + r.begin, m_.data() + r.begin, v_.data() + r.begin, r.count};
  }
  void release(Range, bool) override {}

 private:
  std::vector<float> master_, m_, v_;
};

}  // namespace

std::unique_ptr<OptimizerStateStore> make_resident_state_store(std::span<const float> master_init) {
  return std::make_unique<ResidentStateStore>(master_init);
}

}  // namespace strata::zero
