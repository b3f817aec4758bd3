// A Session (daemon/serve/session.h) with the real RenderWorker, over one end of a
// socketpair whose other end the test holds as the client: what a connection does while
// the first piece of its `trace` waits for the render thread behind its uid's other job
// (a job of the test's that waits until the test lets it finish, so nothing here is
// timed). The test thread is the io thread: it runs the io_context.
#include "daemon/serve/session.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "daemon/serve/commands.h"
#include "daemon/serve/config.h"
#include "daemon/serve/render_worker.h"
#include "daemon/state/collector.h"
#include "proto/codec.h"
#include "tests/daemon/daemon_test_util.h"

namespace steptrace::daemon {
namespace {

using std::chrono::milliseconds;

class SessionTest : public ::testing::Test {
 protected:
  SessionTest() : collector_(Limits{}, test::alive_env()), worker_(io_, collector_, &counters_) {}
  ~SessionTest() override {
    release();
    if (session_) session_->close();
    worker_.stop();
    // The cancelled waits and the replies posted back run now, and let the session go
    // before what it refers to.
    io_.restart();
    io_.poll();
    session_.reset();
    if (client_ >= 0) ::close(client_);
  }

  // A session over a socketpair, started; the test's end in client_.
  void connect() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    client_ = fds[1];
    Session::Socket socket(io_);
    socket.assign(boost::asio::local::stream_protocol(), fds[0]);
    session_ = std::make_shared<Session>(
        std::move(socket), shared_, [](Session*) {}, ucred{::getpid(), kUid, kUid});
    session_->start();
  }
  // Takes kUid's turn on the bulk lane until release(): its next job waits behind it.
  void hold_the_uids_turn() {
    worker_.submit_task(
        [gate = gate_.get_future().share()] {
          gate.wait();
          return std::string();
        },
        [](std::string) {}, owner());
  }
  void release() {
    if (!released_) gate_.set_value();
    released_ = true;
  }
  // Runs the io_context until `pred` holds; false if it did not within 10 s (a bound for
  // a failing test, never a measurement).
  bool run_until(const std::function<bool()>& pred) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!pred()) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      if (io_.stopped()) io_.restart();
      io_.run_one_for(milliseconds(10));
    }
    return true;
  }
  bool send(const std::string& line) {
    return ::write(client_, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  }
  // What the client can read now (the session wrote it before the test looked).
  std::string readable() {
    std::string out;
    char buf[4096];
    pollfd p{client_, POLLIN, 0};
    while (::poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0) {
      const ssize_t n = ::read(client_, buf, sizeof buf);
      if (n <= 0) break;
      out.append(buf, static_cast<std::size_t>(n));
    }
    return out;
  }
  static RenderOwner owner() { return RenderOwner::of_uid(kUid); }
  std::size_t waiting() const { return worker_.waiting(RenderLane::kBulk, owner()); }

  static constexpr std::uint32_t kUid = 4321;
  boost::asio::io_context io_;
  Collector collector_;
  ServerCounters counters_;
  Config config_;
  CommandTable commands_;
  RateLimitedLog log_;
  RenderWorker worker_;
  SessionShared shared_{collector_, counters_,         config_, commands_, log_,
                        &worker_,   test::alive_env(), 0,       false};
  std::shared_ptr<Session> session_;
  std::promise<void> gate_;
  bool released_ = false;
  int client_ = -1;
};

// The client closes while its trace's first piece (the one that chooses the processes:
// --children walks /proc there) waits for the render thread: the session sees the
// hang-up at once, counts it in connections.closed_waiting and drops the reply, which
// gives the uid's trace slot back before the render thread is free again (the uid may
// start both of its 2 traces); the piece, when its turn comes, renders nothing.
TEST_F(SessionTest, AClientGoneWhileItsTracesFirstPieceWaitsIsNotRenderedFor) {
  connect();
  hold_the_uids_turn();
  ASSERT_TRUE(send("trace --pid " + std::to_string(::getpid()) + " --children\n"));
  ASSERT_TRUE(run_until([&] { return waiting() == 1; }));
  ::close(client_);
  client_ = -1;
  ASSERT_TRUE(run_until([&] { return counters_.closed_waiting == 1; }));

  const CommandContext context{collector_, kUid, 0};
  std::vector<Reply> traces;
  for (int i = 0; i < 2; ++i) {
    traces.push_back(commands_.dispatch("trace", context));
    EXPECT_TRUE(traces.back().stream) << i << ": " << traces.back().text;
  }
  traces.clear();

  release();
  EXPECT_TRUE(run_until([&] { return worker_.pending() == 0; }));
  EXPECT_EQ(counters_.closed_waiting, 1u);
}

// A client that only shut down its writing side (as the CLI does after its command) is
// not gone: its trace's piece waits its turn and the document comes.
TEST_F(SessionTest, AHalfClosedClientStillGetsItsTraceAfterTheWait) {
  connect();
  hold_the_uids_turn();
  ASSERT_TRUE(send("trace\n"));
  ASSERT_EQ(::shutdown(client_, SHUT_WR), 0);
  ASSERT_TRUE(run_until([&] { return waiting() == 1; }));
  release();
  std::string reply;
  ASSERT_TRUE(run_until([&] {
    reply += readable();
    return reply.ends_with("}}\n") || reply.starts_with("error");
  })) << reply;
  EXPECT_TRUE(reply.starts_with("{\"traceEvents\":[")) << reply;
  EXPECT_EQ(counters_.closed_waiting, 0u);
}

// The shutdown's drain that meets a binary peer's end of stream ends the stream's input,
// as a read outside the drain does: a frame the end cut short is a protocol error, and
// the last pass over the peer's rings refuses what waits for a registration (the peer is
// gone) instead of leaving it in a ring for a next daemon no one will offer it to.
TEST_F(SessionTest, ADrainThatMeetsThePeersEndOfStreamEndsItsInput) {
  connect();
  std::vector<std::byte> buf(256);
  proto::Encoder enc(buf);
  enc.hello("test-0.0", "session-test", proto::kProtocolVersion);
  enc.flush(1);
  const std::size_t whole = enc.size();
  enc.flush(2);
  // The hello and the first Flush, then 5 bytes of the second: a frame cut short.
  ASSERT_EQ(::write(client_, buf.data(), whole + 5), static_cast<ssize_t>(whole + 5));
  ASSERT_TRUE(run_until([&] { return !readable().empty(); }));  // the first FlushAck
  session_->begin_drain();
  io_.restart();
  io_.poll();  // the cancelled read's handler
  ::close(client_);
  client_ = -1;
  session_->drain(Session::Clock::now() + std::chrono::seconds(5));
  std::uint64_t errors = 0;
  for (const auto& [kind, n] : counters_.protocol_errors) errors += n;
  EXPECT_EQ(errors, 1u)
      << "the end of stream met by the drain was not taken for the end of the peer's input";
}

}  // namespace
}  // namespace steptrace::daemon
