// How serve's ClientStream (daemon/serve/client_stream.h) hands what it decoded to the
// Collector: each binary message kind reaches the Collector's call for it (the read
// model shows it), an error the Collector returns ends the stream (answered with an
// Error frame; later frames are not applied), and so does a refused attach. What the
// Collector then does with each message is tested in tests/daemon/state/, without a
// stream.
#include "daemon/serve/client_stream.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "daemon/state/collector.h"
#include "tests/daemon/daemon_test_util.h"

namespace steptrace::daemon {
namespace {

using test::Connection;
using test::end;
using test::FakeWorld;
using test::start;
using State = ClientStream::State;

constexpr std::uint32_t kForward = 0;

const ProcessFigures* process_of(const std::vector<ProcessFigures>& processes, std::int32_t pid) {
  for (const ProcessFigures& p : processes) {
    if (p.key.pid == pid) return &p;
  }
  return nullptr;
}

std::uint64_t count_of(const ProcessFigures& p, std::string_view step) {
  for (const StepFigures& s : p.steps) {
    if (s.name == step) return s.hist().count();
  }
  return 0;
}

using ClientStreamIngestTest = test::CollectorFixture;

TEST_F(ClientStreamIngestTest, EveryMessageKindReachesTheCollector) {
  Connection a(*collector_, world_.spawn(100, 5, "trainer"));
  Connection b(*collector_, world_.spawn(200, 6, "eval"));
  ASSERT_FALSE(a.attach_error());
  ASSERT_FALSE(b.attach_error());
  ASSERT_NE(a.handle(), b.handle());
  ASSERT_FALSE(a.identity("llama-7", 1, 1, 2));
  ASSERT_FALSE(a.register_step(proto::kFirstCustomStep, "Tokenize"));
  ASSERT_FALSE(
      a.events({start(1, kForward, 0), end(1, kForward, 10), start(1, proto::kFirstCustomStep, 20),
                end(1, proto::kFirstCustomStep, 30)}));
  ASSERT_FALSE(a.ledger(test::reserve_record("GPU-x", 1, 4096, "qlora", 1, 40)));
  ASSERT_FALSE(a.dropped_by_cause({{5, 7, 1, 2}}));
  ASSERT_FALSE(b.dropped(12));
  EXPECT_TRUE(a.sent().empty());  // nothing to answer
  EXPECT_EQ(a.stream().state(), State::kBinary);

  const auto view = collector_->freeze();
  const std::vector<ProcessFigures> processes = view->processes();
  ASSERT_EQ(processes.size(), 2u);
  const ProcessFigures* p = process_of(processes, 100);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->client, "trainer");  // the hello's process name and library version
  EXPECT_EQ(p->library_version, "0.1.0");
  EXPECT_EQ(p->connections, 1u);
  EXPECT_EQ(p->job, "llama-7");
  EXPECT_EQ(p->rank, 1u);
  EXPECT_EQ(p->local_rank, 1u);
  EXPECT_EQ(p->world_size, 2u);
  EXPECT_EQ(count_of(*p, "Forward"), 1u);
  EXPECT_EQ(count_of(*p, "Tokenize"), 1u);
  EXPECT_EQ(p->dropped_by_cause,
            (std::array<std::uint64_t, proto::kReportDropCauseCount>{5, 7, 1, 2, 0}));
  EXPECT_EQ(p->dropped, 15u);
  const ProcessFigures* q = process_of(processes, 200);
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->dropped, 12u);
  EXPECT_EQ(view->ledger().gpus.at("GPU-x").reservations.at(1).holder.pid, 100);
  EXPECT_EQ(view->counters().events_received, 4u);
}

TEST_F(ClientStreamIngestTest, AnErrorOfTheCollectorEndsTheStreamAndLaterFramesAreNotApplied) {
  Connection c(*collector_, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(c.register_step(proto::kFirstCustomStep, "Tokenize"));
  EXPECT_EQ(c.register_step(proto::kFirstCustomStep, "Other"), make_error_code(errc::bad_string));
  EXPECT_EQ(c.stream().state(), State::kFinishing);
  // Answered with an Error frame.
  ASSERT_GE(c.sent().size(), sizeof(proto::FrameHeader));
  proto::FrameHeader header{};
  std::memcpy(&header, c.sent().data(), sizeof header);
  EXPECT_EQ(header.type, static_cast<std::uint16_t>(proto::FrameType::kError));
  // What comes after is not applied; the failure is given again.
  EXPECT_EQ(c.events({start(1, kForward, 0), end(1, kForward, 10)}),
            make_error_code(errc::bad_string));
  EXPECT_EQ(collector_->counters().events_received, 0u);
  const auto processes = collector_->freeze()->processes();
  ASSERT_EQ(processes.size(), 1u);
  EXPECT_TRUE(processes[0].steps.empty());
}

TEST_F(ClientStreamIngestTest, ARefusedAttachEndsTheStreamWithTheCollectorsError) {
  limits_.max_processes = 1;
  collector_ = std::make_unique<Collector>(limits_, world_.env());
  Connection a(*collector_, world_.spawn(1, 1, "a"));
  ASSERT_FALSE(a.attach_error());
  Connection b(*collector_, world_.spawn(2, 1, "b"));
  EXPECT_EQ(b.attach_error(), make_error_code(errc::limit_reached));
  EXPECT_FALSE(b.stream().handle().has_value());
  EXPECT_FALSE(b.sent().empty());  // an Error frame
  EXPECT_EQ(b.events({start(1, kForward, 0)}), make_error_code(errc::limit_reached));
  EXPECT_EQ(collector_->freeze()->processes().size(), 1u);
  EXPECT_EQ(collector_->counters().limits_hit.at("max_processes"), 1u);
}

}  // namespace
}  // namespace steptrace::daemon
