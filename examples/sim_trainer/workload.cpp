#include "workload.h"

#include <steptrace/steptrace.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>

namespace sim {
namespace {

using steptrace::Span;
using steptrace::Step;

// out = a (n x n) * b (n x n), row-major.
void matmul(const std::vector<float>& a, const std::vector<float>& b, std::vector<float>& out,
            std::size_t n) {
  Span span(Step::kMatmul);
  std::fill(out.begin(), out.end(), 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t k = 0; k < n; ++k) {
      const float aik = a[i * n + k];
      for (std::size_t j = 0; j < n; ++j) out[i * n + j] += aik * b[k * n + j];
    }
  }
}

}  // namespace

Workload::Workload(std::size_t dim, unsigned seed) : dim_(dim) {
  const std::size_t n = dim * dim;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f / static_cast<float>(dim));
  for (auto* v : {&input_, &w1_, &w2_}) {
    v->resize(n);
    for (auto& x : *v) x = dist(rng);
  }
  for (auto* v : {&hidden_, &output_, &w2_t_, &grad_hidden_, &staging_}) v->assign(n, 0.0f);
}

void Workload::step() {
  const std::size_t n = dim_;
  {
    Span forward(Step::kForward);
    std::unique_ptr<float[]> batch;
    {
      // A fresh activation buffer per step, as a framework's allocator would hand out.
      Span alloc(Step::kAlloc);
      batch = std::make_unique<float[]>(n * n);
    }
    {
      // Host -> "device": copy the batch into the staging buffer the model reads.
      Span transfer(Step::kTransfer);
      std::memcpy(batch.get(), input_.data(), n * n * sizeof(float));
      std::memcpy(staging_.data(), batch.get(), n * n * sizeof(float));
    }
    matmul(staging_, w1_, hidden_, n);
    {
      Span attention(Step::kAttention);
      for (std::size_t i = 0; i < n; ++i) {  // row-wise softmax
        float* row = &hidden_[i * n];
        const float max = *std::max_element(row, row + n);
        float sum = 0.0f;
        for (std::size_t j = 0; j < n; ++j) sum += (row[j] = std::exp(row[j] - max));
        for (std::size_t j = 0; j < n; ++j) row[j] /= sum;
      }
    }
    matmul(hidden_, w2_, output_, n);
  }
  {
    Span backward(Step::kBackward);
    {
      Span transpose(Step::kTranspose);
      for (std::size_t i = 0; i < n; ++i) {
        for (std::size_t j = 0; j < n; ++j) w2_t_[j * n + i] = w2_[i * n + j];
      }
    }
    // d(loss)/d(output) = output for loss = |output|^2 / 2; back through w2.
    double loss = 0.0;
    for (float v : output_) loss += 0.5 * static_cast<double>(v) * v;
    loss_ = loss;
    matmul(output_, w2_t_, grad_hidden_, n);
    // Weight update for w2: hidden^T * output, scaled; reuses w2_t_ as scratch.
    matmul(hidden_, output_, w2_t_, n);
    constexpr float kLearningRate = 1e-3f;
    for (std::size_t i = 0; i < n * n; ++i) {
      w2_[i] -= kLearningRate * w2_t_[i];
      w1_[i] -= kLearningRate * grad_hidden_[i] * 1e-3f;
    }
  }
}

double Workload::checksum() const {
  double sum = loss_;
  for (float v : w2_) sum += v;
  return sum;
}

}  // namespace sim
