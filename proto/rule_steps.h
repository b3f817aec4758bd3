// The 50% rule's step lists (PROTOCOL.md section 10.4 "rule"): which steps count as
// compute and which as CPU overhead, as the daemon's config ("overhead_rule") and
// `report --compute STEP,... --overhead STEP,...` name them, checked by one grammar that
// the daemon and the CLI share, so the CLI can refuse a bad list before it asks.
//
// A step is named by its name, built-in ("Matmul") or custom: 1..kMaxNameLength
// printable ASCII characters without blanks or commas (a word of a command line, and a
// list is those words joined by commas). A list has 1..kMaxRuleSteps names, none twice;
// no step is in both lists. A name no process registered is not an error: it counts 0.
// Standard library (and proto/wire_format.h's name bound) only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "proto/wire_format.h"

namespace steptrace::proto {

inline constexpr std::size_t kMaxRuleSteps = 64;

// The reference's question: Matmul against Transpose + Alloc.
inline constexpr std::string_view kDefaultComputeSteps[] = {"Matmul"};
inline constexpr std::string_view kDefaultOverheadSteps[] = {"Transpose", "Alloc"};

inline bool is_rule_step_name(std::string_view name) {
  if (name.empty() || name.size() > kMaxNameLength) return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return c > 0x20 && c <= 0x7e && c != ','; });
}

// What is wrong with a list (without naming the option or key), or nullopt.
inline std::optional<std::string> rule_steps_problem(const std::vector<std::string>& steps) {
  if (steps.empty()) return "needs at least one step";
  if (steps.size() > kMaxRuleSteps) {
    return "takes at most " + std::to_string(kMaxRuleSteps) + " steps";
  }
  for (std::size_t i = 0; i < steps.size(); ++i) {
    if (!is_rule_step_name(steps[i])) {
      return "a step name has 1.." + std::to_string(kMaxNameLength) +
             " printable characters without blanks or commas";
    }
    if (std::find(steps.begin(), steps.begin() + static_cast<std::ptrdiff_t>(i), steps[i]) !=
        steps.begin() + static_cast<std::ptrdiff_t>(i)) {
      return "names " + steps[i] + " twice";
    }
  }
  return std::nullopt;
}

// A step in both lists, or nullopt.
inline std::optional<std::string> rule_steps_overlap(const std::vector<std::string>& compute,
                                                     const std::vector<std::string>& overhead) {
  for (const std::string& step : compute) {
    if (std::find(overhead.begin(), overhead.end(), step) != overhead.end()) return step;
  }
  return std::nullopt;
}

// "A,B,C" as its names, or what is wrong with it. A reason quotes only a name that
// passed is_rule_step_name (printable); the caller echoes the text itself, cut and
// made printable.
inline std::variant<std::vector<std::string>, std::string> parse_rule_steps(std::string_view text) {
  std::vector<std::string> steps;
  if (text.size() > kMaxRuleSteps * (kMaxNameLength + 1)) {
    return "takes at most " + std::to_string(kMaxRuleSteps) + " steps";
  }
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    steps.emplace_back(text.substr(start, comma - start));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  if (text.empty()) steps.clear();
  for (const std::string& step : steps) {
    if (step.empty()) return std::string("has an empty step name (STEP,STEP,...)");
  }
  if (auto problem = rule_steps_problem(steps)) return std::move(*problem);
  return steps;
}

}  // namespace steptrace::proto
