// libsteptrace's C++ wrapper (C++17, header-only over the C ABI in steptrace.h).
//
//   steptrace::Span span(steptrace::Step::kForward);   // ends when it leaves scope
//   auto loss = steptrace::in_span(steptrace::Step::kBackward, [&] { return backward(); });
#ifndef STEPTRACE_STEPTRACE_HPP_
#define STEPTRACE_STEPTRACE_HPP_

#include <steptrace/steptrace.h>

#include <cstdint>
#include <string>
#include <utility>

namespace steptrace {

enum class Step : std::uint32_t {
  kForward = STEPTRACE_FORWARD,
  kBackward = STEPTRACE_BACKWARD,
  kMatmul = STEPTRACE_MATMUL,
  kAttention = STEPTRACE_ATTENTION,
  kTranspose = STEPTRACE_TRANSPOSE,
  kAlloc = STEPTRACE_ALLOC,
  kTransfer = STEPTRACE_TRANSFER,
  kLedgerReserve = STEPTRACE_LEDGER_RESERVE,
  kLedgerCleanup = STEPTRACE_LEDGER_CLEANUP,
  kVramQuery = STEPTRACE_VRAM_QUERY,
  kWaitPoll = STEPTRACE_WAIT_POLL,
  kLedgerRelease = STEPTRACE_LEDGER_RELEASE,
};

inline std::uint32_t step_id(Step step) noexcept { return static_cast<std::uint32_t>(step); }

// A custom step id for `name`; UINT32_MAX when invalid or over the limit.
inline std::uint32_t register_step(const std::string& name) noexcept {
  return steptrace_register_step(name.c_str());
}

// Records a span from construction to destruction (RAII). Not copyable.
class Span {
 public:
  explicit Span(std::uint32_t step) noexcept : step_(step) { steptrace_start(step_); }
  explicit Span(Step step) noexcept : Span(step_id(step)) {}
  ~Span() { steptrace_end(step_); }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  std::uint32_t step_;
};

// Runs f() inside a span of `step` and returns what f returns.
template <typename F>
decltype(auto) in_span(Step step, F&& f) {
  Span span(step);
  return std::forward<F>(f)();
}
template <typename F>
decltype(auto) in_span(std::uint32_t step, F&& f) {
  Span span(step);
  return std::forward<F>(f)();
}

}  // namespace steptrace

#endif  // STEPTRACE_STEPTRACE_HPP_
