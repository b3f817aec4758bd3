// Custom step ids: stable per name, dense from kFirstCustomStep, bounded, validated.
#include "client/src/step_registry.h"

#include <gtest/gtest.h>

#include <string>

namespace steptrace::client {
namespace {

TEST(StepRegistry, IdsAreDenseAndStablePerName) {
  StepRegistry r;
  const auto a = r.register_step("Tokenize");
  const auto b = r.register_step("Optimizer");
  EXPECT_EQ(a, proto::kFirstCustomStep);
  EXPECT_EQ(b, proto::kFirstCustomStep + 1);
  EXPECT_EQ(r.register_step("Tokenize"), a);
  EXPECT_EQ(r.count(), 2u);
  EXPECT_EQ(r.name(0), "Tokenize");
  EXPECT_EQ(r.name(1), "Optimizer");
}

TEST(StepRegistry, RejectsInvalidNames) {
  StepRegistry r;
  EXPECT_EQ(r.register_step(""), kInvalidStep);
  EXPECT_EQ(r.register_step(std::string(64, 'x')), kInvalidStep);
  EXPECT_NE(r.register_step(std::string(63, 'x')), kInvalidStep);
  EXPECT_EQ(r.register_step("tab\there"), kInvalidStep);
  EXPECT_EQ(r.register_step("caf\xc3\xa9"), kInvalidStep);
  EXPECT_EQ(r.count(), 1u);
}

TEST(StepRegistry, StopsAtTheLimit) {
  StepRegistry r(3);
  EXPECT_NE(r.register_step("a"), kInvalidStep);
  EXPECT_NE(r.register_step("b"), kInvalidStep);
  EXPECT_NE(r.register_step("c"), kInvalidStep);
  EXPECT_EQ(r.register_step("d"), kInvalidStep);
  EXPECT_EQ(r.register_step("b"), proto::kFirstCustomStep + 1);  // known names still resolve
}

TEST(StepRegistry, DefaultLimitIsTheProtocolLimit) {
  StepRegistry r;
  for (std::uint32_t i = 0; i < proto::kMaxCustomSteps; ++i) {
    ASSERT_EQ(r.register_step("s" + std::to_string(i)), proto::kFirstCustomStep + i);
  }
  EXPECT_EQ(r.register_step("one-more"), kInvalidStep);
  EXPECT_TRUE(proto::is_custom_step(proto::kFirstCustomStep + proto::kMaxCustomSteps - 1));
}

}  // namespace
}  // namespace steptrace::client
