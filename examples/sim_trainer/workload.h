// A tiny two-layer model trained on the CPU, so sim_trainer's spans time real work:
// each step runs Forward (Alloc, Transfer, Matmul, Attention softmax, Matmul) and
// Backward (Transpose, Matmul, Matmul, weight update), every phase inside its steptrace
// span. Sizes are small so a run of a few workers takes seconds at most.
#pragma once

#include <cstddef>
#include <vector>

namespace sim {

class Workload {
 public:
  explicit Workload(std::size_t dim, unsigned seed);
  // One training step, recorded as steptrace spans.
  void step();
  // A value depending on all the work done, so none of it can be optimised away.
  double checksum() const;

 private:
  std::size_t dim_;
  std::vector<float> input_, w1_, w2_, hidden_, output_, w2_t_, grad_hidden_, staging_;
  double loss_ = 0.0;
};

}  // namespace sim
