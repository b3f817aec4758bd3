// The seed of a test's random choices (event counts, kill moments, timing): printed, so
// that STEPTRACE_TEST_SEED=N repeats a run, and named in every failure through
// SCOPED_TRACE(seed_note(seed, ...)).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>

namespace steptrace::testing {

// STEPTRACE_TEST_SEED, else a random seed.
inline std::uint64_t test_seed() {
  if (const char* env = std::getenv("STEPTRACE_TEST_SEED"); env != nullptr && *env != '\0') {
    return std::strtoull(env, nullptr, 10);
  }
  std::random_device device;
  return (std::uint64_t{device()} << 32) | device();
}

// test_seed(), printed on stderr as "TEST: seed N (STEPTRACE_TEST_SEED)".
inline std::uint64_t announced_seed(const std::string& test) {
  const std::uint64_t seed = test_seed();
  std::cerr << test << ": seed " << seed << " (STEPTRACE_TEST_SEED)\n";
  return seed;
}

// For SCOPED_TRACE: "seed N (STEPTRACE_TEST_SEED=N repeats WHAT)".
inline std::string seed_note(std::uint64_t seed, const std::string& what = "this run") {
  return "seed " + std::to_string(seed) + " (STEPTRACE_TEST_SEED=" + std::to_string(seed) +
         " repeats " + what + ")";
}

}  // namespace steptrace::testing
