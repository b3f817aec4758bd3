// The two temporary users of a hostile test (one greedy or foreign, one innocent): the
// test is skipped without root (useradd needs it; CI runs as root), and a failed useradd
// is a fatal failure. SetUp calls it, then returns at once when the test cannot go on:
//   make_two_users("stshare", greedy_, innocent_);
//   if (IsSkipped() || HasFatalFailure()) return;
#pragma once

#include <unistd.h>

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "tests/support/temporary_user.h"

namespace steptrace::testing {

// Names: PREFIX + (pid mod 10^6) + "a" / "b", so concurrent test binaries do not collide.
inline void make_two_users(const std::string& prefix, std::unique_ptr<TemporaryUser>& a,
                           std::unique_ptr<TemporaryUser>& b) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "needs root: it creates two temporary users (useradd) and runs clients "
                    "as them; CI runs it as root";
  }
  const std::string tag = std::to_string(::getpid() % 1000000);
  a = std::make_unique<TemporaryUser>(prefix + tag + "a");
  b = std::make_unique<TemporaryUser>(prefix + tag + "b");
  ASSERT_TRUE(a->created()) << "useradd " << a->name() << " failed";
  ASSERT_TRUE(b->created()) << "useradd " << b->name() << " failed";
}

}  // namespace steptrace::testing
