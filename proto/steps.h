// The built-in steps, defined once: id (the wire's step id, PROTOCOL.md 4.5), name (what
// reports show) and whether it is a ledger step (a span the daemon attributes to the
// GPU its thread annotated inside it).
//
// Everything else is derived from kBuiltinSteps or checked against it:
//   below                      kBuiltinStepCount, kBuiltinStepNames, is_ledger_step() ...
//                              (proto/wire_format.h includes this header)
//   client/src/c_api.cpp       enum steptrace_step (steptrace.h) and steptrace::Step
//                              (steptrace.hpp), by static_assert
//   bindings/python            steptrace.Step, by the client_python_steps test
//   proto/PROTOCOL.md 4.5      by hand
// Ids are on the wire and in the C ABI: a step is only ever added at the end.
// Nothing here allocates, throws at run time or does I/O.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace steptrace::proto {

struct BuiltinStep {
  std::uint32_t id;
  std::string_view name;
  bool ledger;  // a ledger step (LedgerReserve .. LedgerRelease)
};

// clang-format off
inline constexpr std::array kBuiltinSteps = {
    //          id  name             ledger step
    BuiltinStep{0,  "Forward",       false},
    BuiltinStep{1,  "Backward",      false},
    BuiltinStep{2,  "Matmul",        false},
    BuiltinStep{3,  "Attention",     false},
    BuiltinStep{4,  "Transpose",     false},
    BuiltinStep{5,  "Alloc",         false},
    BuiltinStep{6,  "Transfer",      false},
    BuiltinStep{7,  "LedgerReserve", true},
    BuiltinStep{8,  "LedgerCleanup", true},
    BuiltinStep{9,  "VramQuery",     true},
    BuiltinStep{10, "WaitPoll",      true},
    BuiltinStep{11, "LedgerRelease", true},
};
// clang-format on

inline constexpr std::uint32_t kBuiltinStepCount = kBuiltinSteps.size();

namespace detail {
constexpr bool builtin_steps_well_formed() {
  for (std::size_t i = 0; i < kBuiltinSteps.size(); ++i) {
    const BuiltinStep& s = kBuiltinSteps[i];
    if (s.id != i) return false;  // dense, in id order: the id indexes the table
    // Printable ASCII, like a RegisterStep name (wire_format.h checks the length).
    if (s.name.empty()) return false;
    for (const char c : s.name) {
      if (c < 0x20 || c > 0x7E) return false;
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (kBuiltinSteps[j].name == s.name) return false;
    }
  }
  return true;
}
// Ledger steps as bits of one word: is_ledger_step() is a shift, not a table load.
constexpr std::uint64_t ledger_step_mask() {
  std::uint64_t mask = 0;
  for (const BuiltinStep& s : kBuiltinSteps) {
    if (s.ledger) mask |= std::uint64_t{1} << s.id;
  }
  return mask;
}
}  // namespace detail

static_assert(detail::builtin_steps_well_formed(),
              "built-in step ids must be 0..n-1 in order, names unique and valid");
static_assert(kBuiltinStepCount <= 64, "is_ledger_step keeps one bit per built-in step");

inline constexpr std::uint64_t kLedgerStepMask = detail::ledger_step_mask();

constexpr bool is_builtin_step(std::uint32_t step) { return step < kBuiltinStepCount; }

// The ledger steps, whose spans the daemon attributes to a GPU.
constexpr bool is_ledger_step(std::uint32_t step) {
  return step < kBuiltinStepCount && ((kLedgerStepMask >> step) & 1u) != 0;
}

// The name of a built-in step; empty for any other id.
constexpr std::string_view builtin_step_name(std::uint32_t step) {
  return is_builtin_step(step) ? kBuiltinSteps[step].name : std::string_view();
}

// The id of the built-in step called `name`; nullopt when none is.
constexpr std::optional<std::uint32_t> find_builtin_step(std::string_view name) {
  for (const BuiltinStep& s : kBuiltinSteps) {
    if (s.name == name) return s.id;
  }
  return std::nullopt;
}

// The id of a built-in step named in code that means that one step
// (`constexpr auto kMatmul = builtin_step_id("Matmul");`): a name not in the table does
// not compile.
consteval std::uint32_t builtin_step_id(std::string_view name) {
  // value() throws on nullopt, and a throw is not a constant expression.
  return find_builtin_step(name).value();
}

// The names alone, indexed by id.
inline constexpr std::array<std::string_view, kBuiltinStepCount> kBuiltinStepNames = [] {
  std::array<std::string_view, kBuiltinStepCount> names{};
  for (const BuiltinStep& s : kBuiltinSteps) names[s.id] = s.name;
  return names;
}();

}  // namespace steptrace::proto
