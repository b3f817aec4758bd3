// The protocol side of a connection (daemon/serve/client_stream.h), driven directly:
// mode sniffing, the error path (counted, logged, answered in the peer's dialect, the
// Error frame naming its errc as PROTOCOL.md 4.9 says), timeouts, replies in order while
// a render is out, back-pressure, rejection and the shutdown drain.
#include "daemon/serve/client_stream.h"
#include "daemon/report/report.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "tests/daemon/daemon_test_util.h"

namespace steptrace::daemon {
namespace {

using test::Connection;
using test::FakeWorld;
using test::RecordingTransport;
using test::StreamWorld;
using State = ClientStream::State;
using namespace std::chrono_literals;

// Decodes what the daemon sent to a binary client.
std::vector<proto::Message> client_view(const std::string& sent) {
  proto::Decoder decoder(proto::Side::kClient);
  decoder.feed(std::as_bytes(std::span(sent.data(), sent.size())));
  std::vector<proto::Message> out;
  for (;;) {
    auto r = decoder.next();
    EXPECT_FALSE(r.error) << r.error.message();
    if (r.error || !r.message) break;
    out.push_back(*r.message);
  }
  return out;
}

// A client's hello, read by `stream` in one piece.
void send_hello(ClientStream& stream, std::string_view name) {
  std::array<std::byte, sizeof(proto::Hello)> hello{};
  proto::Encoder enc(hello);
  ASSERT_TRUE(enc.hello("0.1.0", name));
  const auto buffer = stream.read_buffer();
  std::memcpy(buffer.data(), hello.data(), hello.size());
  stream.received(hello.size());
}

std::string error_text(const proto::Message& m) {
  const auto* e = std::get_if<proto::ErrorReport>(&m);
  if (e == nullptr) return "(not an Error frame)";
  return std::string(e->message, strnlen(e->message, sizeof e->message));
}

class ClientStreamTest : public ::testing::Test {
 protected:
  ClientStreamTest()
      : collector_(Limits{}, world_.env()),
        streams_(collector_),
        transport_(collector_),
        start_(ClientStream::Clock::now()) {}

  ClientStream& open(bool reject = false) {
    stream_.emplace(streams_.shared, transport_, world_.spawn(100, 5, "trainer"),
                    reject ? Refusal::kMaxConnections : Refusal::kNone, start_);
    transport_.attach(*stream_);
    return *stream_;
  }
  void feed(std::string_view bytes) {
    while (!bytes.empty()) {
      ASSERT_TRUE(stream_->wants_input());
      const auto buffer = stream_->read_buffer();
      const std::size_t n = std::min(buffer.size(), bytes.size());
      std::memcpy(buffer.data(), bytes.data(), n);
      bytes.remove_prefix(n);
      stream_->received(n);
    }
  }
  void feed(std::span<const std::byte> bytes) {
    feed(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  }
  std::uint64_t errors(const std::string& kind) const {
    const auto& m = streams_.counters.protocol_errors;
    const auto it = m.find(kind);
    return it == m.end() ? 0 : it->second;
  }

  FakeWorld world_;
  Collector collector_;
  StreamWorld streams_;
  RecordingTransport transport_;
  ClientStream::Clock::time_point start_;
  std::optional<ClientStream> stream_;
};

TEST_F(ClientStreamTest, FirstByteChoosesTheDialect) {
  open();
  EXPECT_EQ(stream_->state(), State::kSniffing);
  feed("ping\n");
  EXPECT_EQ(stream_->state(), State::kText);
  EXPECT_EQ(transport_.sent, "pong\n");

  RecordingTransport other(collector_);
  ClientStream binary(streams_.shared, other, world_.spawn(101, 5, "b"), Refusal::kNone, start_);
  send_hello(binary, "b");
  EXPECT_EQ(binary.state(), State::kBinary);
  EXPECT_TRUE(binary.handle().has_value());
  binary.closed();
}

TEST_F(ClientStreamTest, ProtocolErrorFrameNamesItsErrcAndClosesTheStream) {
  open();
  std::vector<std::byte> buf(1024);
  proto::Encoder enc(buf);
  ASSERT_TRUE(enc.hello("0.1.0", "trainer"));
  const std::vector<proto::EventRecord> bad = {
      {1, 1, 5000, static_cast<std::uint8_t>(proto::EventKind::kStart), 0}};
  ASSERT_EQ(enc.events(bad), 1u);
  feed(enc.bytes());

  EXPECT_EQ(stream_->failure(), make_error_code(errc::bad_step_id));
  EXPECT_EQ(stream_->state(), State::kFinishing);
  EXPECT_FALSE(stream_->wants_input());
  EXPECT_EQ(errors("bad_step_id"), 1u);
  const auto sent = client_view(transport_.sent);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(std::get<proto::ErrorReport>(sent[0]).code,
            static_cast<std::uint32_t>(proto::ErrorCode::kProtocol));
  EXPECT_EQ(error_text(sent[0]), "bad_step_id: step id out of range");
}

// Issue 15, item 12: the peer's start time is read at accept; if its pid runs another
// process by the hello, whoever holds the socket is not the process that connected.
TEST_F(ClientStreamTest, AHelloFromAPidNowRunningAnotherProcessIsRefused) {
  streams_.shared.env = world_.env();
  open();                                // pid 100, start time 5
  world_.spawn(100, 6, "someone-else");  // the pid is reused
  send_hello(*stream_, "trainer");
  EXPECT_EQ(stream_->failure(), make_error_code(errc::permission_denied));
  EXPECT_FALSE(stream_->handle().has_value());
  const auto replies = client_view(transport_.sent);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(error_text(replies[0]),
            "permission_denied: pid 100 runs another process than the one that connected (pid "
            "reused)");
  EXPECT_EQ(streams_.counters.protocol_errors["permission_denied"], 1u);
  EXPECT_TRUE(report::report_json(*collector_.freeze(), std::nullopt)["processes"].empty());

  // The same process, still there: accepted; gone since (it sent and exited): accepted.
  RecordingTransport t1(collector_), t2(collector_);
  ClientStream same(streams_.shared, t1, world_.spawn(101, 5, "a"), Refusal::kNone, start_);
  send_hello(same, "a");
  EXPECT_TRUE(same.handle().has_value());
  ClientStream gone(streams_.shared, t2, world_.spawn(102, 5, "b"), Refusal::kNone, start_);
  world_.kill(102);
  send_hello(gone, "b");
  EXPECT_TRUE(gone.handle().has_value());
  same.closed();
  gone.closed();
}

TEST_F(ClientStreamTest, UnsupportedVersionIsAnsweredWithTheExactMessage) {
  open();
  std::array<std::byte, sizeof(proto::Hello)> buf{};
  proto::Encoder enc(buf);
  ASSERT_TRUE(enc.hello("0.1.0", "trainer", /*version=*/99));
  feed(enc.bytes());
  const auto sent = client_view(transport_.sent);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(std::get<proto::ErrorReport>(sent[0]).code,
            static_cast<std::uint32_t>(proto::ErrorCode::kUnsupportedVersion));
  EXPECT_EQ(error_text(sent[0]), "unsupported protocol version");
  EXPECT_EQ(errors("unsupported_version"), 1u);
}

TEST_F(ClientStreamTest, FlushIsAcknowledgedAfterWhatCameBefore) {
  open();
  std::vector<std::byte> buf(1024);
  proto::Encoder enc(buf);
  ASSERT_TRUE(enc.hello("0.1.0", "trainer"));
  ASSERT_TRUE(enc.flush(42));
  feed(enc.bytes());
  const auto sent = client_view(transport_.sent);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(std::get<proto::FlushAck>(sent[0]).sequence, 42u);
  EXPECT_EQ(stream_->state(), State::kBinary);
}

TEST_F(ClientStreamTest, TooLongLineIsCountedAnsweredAndFinishes) {
  open();
  feed(std::string(streams_.config.server_limits.max_line_bytes + 1, 'x'));
  EXPECT_EQ(transport_.sent, "error: line too long\n");
  EXPECT_EQ(errors(kLineTooLongKind), 1u);
  EXPECT_EQ(stream_->state(), State::kFinishing);
}

TEST_F(ClientStreamTest, HandshakeTimeoutClosesWithoutAReply) {
  open();
  ASSERT_EQ(stream_->next_deadline(), start_ + 10s);
  stream_->on_timer(start_ + 9s);
  EXPECT_EQ(stream_->state(), State::kSniffing);
  stream_->on_timer(start_ + 10s);
  EXPECT_EQ(stream_->state(), State::kFinishing);
  EXPECT_EQ(errors("timed_out"), 1u);
  EXPECT_EQ(transport_.sent, "");
}

// Issue 15, item 3: text connections that sent a command once and then sit idle are
// closed, so idle connections cannot hold the connection table.
TEST_F(ClientStreamTest, AnIdleTextConnectionIsClosedAfterTextIdleTimeout) {
  streams_.config.timeouts.text_idle_ms = 5000;
  open();
  feed("ping\n");
  EXPECT_EQ(transport_.sent, "pong\n");
  const auto deadline = stream_->next_deadline();
  ASSERT_TRUE(deadline.has_value());
  EXPECT_GE(*deadline, start_ + 5s);
  EXPECT_LE(*deadline, ClientStream::Clock::now() + 5s);
  stream_->on_timer(*deadline - 1ms);
  EXPECT_EQ(stream_->state(), State::kText);
  // Another command restarts the clock.
  feed("ping\n");
  EXPECT_GE(*stream_->next_deadline(), *deadline);
  stream_->on_timer(*stream_->next_deadline());
  EXPECT_EQ(stream_->state(), State::kFinishing);
  EXPECT_EQ(errors("timed_out"), 1u);
  EXPECT_EQ(transport_.sent,
            "pong\npong\nerror: no command within 5000 ms (timeouts.text_idle_ms)\n");
}

TEST_F(ClientStreamTest, ARefusalPerUidNamesTheUidAndTheLimit) {
  RecordingTransport other(collector_);
  ClientStream text(streams_.shared, other, world_.spawn(101, 5, "b", 1234),
                    Refusal::kMaxConnectionsPerUid, start_);
  other.attach(text);
  const auto buffer = text.read_buffer();
  std::memcpy(buffer.data(), "ping\n", 5);
  text.received(5);
  EXPECT_EQ(other.sent,
            "error: too many connections from uid 1234 (max_connections_per_uid=256)\n");
  EXPECT_EQ(text.state(), State::kFinishing);
  EXPECT_FALSE(text.handle().has_value());
}

TEST_F(ClientStreamTest, UnfinishedFrameTimesOutWithTheErrcFirst) {
  open();
  std::vector<std::byte> buf(1024);
  proto::Encoder enc(buf);
  ASSERT_TRUE(enc.hello("0.1.0", "trainer"));
  ASSERT_TRUE(enc.flush(1));
  feed(enc.bytes().first(enc.size() - 3));  // the flush frame is cut short
  transport_.sent.clear();
  const auto deadline = stream_->next_deadline();
  ASSERT_TRUE(deadline.has_value());
  stream_->on_timer(*deadline);
  EXPECT_EQ(stream_->state(), State::kFinishing);
  EXPECT_EQ(errors("timed_out"), 1u);
  const auto sent = client_view(transport_.sent);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(error_text(sent[0]), "timed_out: frame not completed within 30 s");
}

// Issue 15, item 2: clients that ask for big reports and never read them cannot pile up
// the daemon's memory: past the bound on unread replies (all connections together) a
// rendered reply is replaced by a short error; with nothing else waiting it goes out.
TEST_F(ClientStreamTest, RepliesAreRefusedWhileTooManyReplyBytesWaitToBeRead) {
  open();
  streams_.shared.counters.reply_bytes_pending = ClientStream::kMaxPendingOutputTotal - 100;
  feed("stats\n");
  EXPECT_EQ(transport_.sent,
            "error: busy: 255 MiB of replies wait for their clients to read them (limit 256 "
            "MiB); retry, or ask for less\n");
  EXPECT_EQ(streams_.counters.replies_refused, 1u);
  EXPECT_EQ(stream_->state(), State::kText);  // the connection stays usable
  transport_.sent.clear();
  streams_.shared.counters.reply_bytes_pending = 0;  // the readers caught up
  feed("stats\n");
  EXPECT_NE(transport_.sent.find("events_received"), std::string::npos) << transport_.sent;
  EXPECT_EQ(streams_.counters.replies_refused, 1u);
  EXPECT_EQ(report::stats_json(*collector_.freeze(&streams_.counters))["replies_refused"], 1);
}

TEST_F(ClientStreamTest, RepliesKeepTheirOrderWhileARenderIsOut) {
  open();
  transport_.hold_renders = true;
  feed("stats\nping\n");
  EXPECT_EQ(stream_->state(), State::kAwaitingReply);
  EXPECT_FALSE(stream_->wants_input());
  EXPECT_EQ(transport_.sent, "");  // ping waits for the stats reply
  transport_.release_renders();
  EXPECT_EQ(stream_->state(), State::kText);
  ASSERT_GT(transport_.sent.size(), 5u);
  EXPECT_EQ(transport_.sent.substr(transport_.sent.size() - 5), "pong\n");
  EXPECT_NE(transport_.sent.find("connections"), std::string::npos) << transport_.sent;
}

TEST_F(ClientStreamTest, LastLineWithoutNewlineIsAnsweredBeforeFinishing) {
  open();
  transport_.hold_renders = true;
  feed("stats");
  stream_->input_ended();
  EXPECT_EQ(stream_->state(), State::kAwaitingReply);  // not finished under its reply
  transport_.release_renders();
  EXPECT_EQ(stream_->state(), State::kFinishing);
  EXPECT_NE(transport_.sent.find("connections"), std::string::npos) << transport_.sent;
}

// `printf 'trace --for 60' | socat ...`: the unfinished last line's timer must not end
// the connection while its (deferred, then streamed) reply is out.
TEST_F(ClientStreamTest, ALastLineWithoutNewlineIsNotTimedOutUnderALongReply) {
  open();
  feed("trace --for 60");
  ASSERT_TRUE(stream_->next_deadline());  // the partial line's frame_s clock
  stream_->input_ended();
  ASSERT_EQ(stream_->state(), State::kAwaitingReply);
  ASSERT_EQ(transport_.deferred.size(), 1u);
  EXPECT_EQ(transport_.deferred_delays[0], std::chrono::milliseconds(60000));
  EXPECT_FALSE(stream_->next_deadline());
  stream_->on_timer(start_ + 61s);
  EXPECT_EQ(stream_->state(), State::kAwaitingReply);
  transport_.fire_deferred();
  EXPECT_EQ(stream_->state(), State::kFinishing);
  EXPECT_TRUE(transport_.sent.starts_with("{\"traceEvents\":[")) << transport_.sent;
  EXPECT_TRUE(transport_.sent.ends_with("}\n")) << transport_.sent;
  EXPECT_EQ(transport_.sent.find("error"), std::string::npos) << transport_.sent;
}

// A `trace --for` keeps its connection busy for its seconds only: the idle clock stops
// while the reply waits and runs again once the reply is out.
TEST_F(ClientStreamTest, ATraceForIsExemptFromTheIdleClockOnlyWhileItWaits) {
  streams_.config.timeouts.text_idle_ms = 5000;
  open();
  feed("trace --for 60\n");
  ASSERT_EQ(stream_->state(), State::kAwaitingReply);
  ASSERT_EQ(transport_.deferred.size(), 1u);
  EXPECT_FALSE(stream_->next_deadline());  // busy, bounded by the reply's own timer
  transport_.fire_deferred();
  ASSERT_EQ(stream_->state(), State::kText);
  EXPECT_TRUE(transport_.sent.ends_with("}\n")) << transport_.sent;
  const auto deadline = stream_->next_deadline();
  ASSERT_TRUE(deadline.has_value());
  EXPECT_LE(*deadline, ClientStream::Clock::now() + 5s);
  stream_->on_timer(*deadline);
  EXPECT_EQ(stream_->state(), State::kFinishing);
  EXPECT_EQ(errors("timed_out"), 1u);
}

TEST_F(ClientStreamTest, EveryAnsweredLineIsACommandServedBlankOnesAreNot) {
  open();
  feed("ping\n\nnope\n  \nstats\n");
  EXPECT_EQ(streams_.counters.commands_served, 3u);
  EXPECT_EQ(collector_.counters().commands_served, 0u);  // the server's count, not ingest's
  const auto view = collector_.freeze(&streams_.counters);
  EXPECT_EQ(view->counters().commands_served, 3u);
}

TEST_F(ClientStreamTest, BackedUpOutputPausesAnswersAndReading) {
  open();
  transport_.unsent = ClientStream::kMaxPendingWrite - 1;
  feed("ping\nping\n");  // the first answer fills the queue; the second waits for room
  EXPECT_EQ(transport_.sent, "pong\n");
  EXPECT_FALSE(stream_->wants_input());
  transport_.unsent = 0;  // the socket took it
  stream_->resume();
  EXPECT_EQ(transport_.sent, "pong\npong\n");
  EXPECT_TRUE(stream_->wants_input());
}

TEST_F(ClientStreamTest, OverMaxConnectionsIsAnsweredInTheClientsDialect) {
  open(/*reject=*/true);
  feed("ping\n");
  EXPECT_EQ(transport_.sent, "error: too many connections (max_connections=1024)\n");
  EXPECT_EQ(stream_->state(), State::kFinishing);

  RecordingTransport other(collector_);
  ClientStream binary(streams_.shared, other, world_.spawn(101, 5, "b"), Refusal::kMaxConnections,
                      start_);
  send_hello(binary, "b");
  const auto sent = client_view(other.sent);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(std::get<proto::ErrorReport>(sent[0]).code,
            static_cast<std::uint32_t>(proto::ErrorCode::kLimit));
  EXPECT_FALSE(binary.handle().has_value());  // never attached
}

TEST_F(ClientStreamTest, DrainAppliesBinaryInputAndAnswersNoCommand) {
  open();
  ASSERT_TRUE(stream_->begin_drain());
  EXPECT_EQ(stream_->state(), State::kDraining);
  std::vector<std::byte> buf(1024);
  proto::Encoder enc(buf);
  ASSERT_TRUE(enc.hello("0.1.0", "trainer"));
  const std::vector<proto::EventRecord> spans = {
      {10, 1, 0, static_cast<std::uint8_t>(proto::EventKind::kStart), 0},
      {30, 1, 0, static_cast<std::uint8_t>(proto::EventKind::kEnd), 0}};
  ASSERT_EQ(enc.events(spans), 2u);
  const auto bytes = enc.bytes();
  const auto buffer = stream_->read_buffer();
  std::memcpy(buffer.data(), bytes.data(), bytes.size());
  stream_->received(bytes.size());
  EXPECT_EQ(collector_.counters().events_received, 2u);

  RecordingTransport other(collector_);
  ClientStream text(streams_.shared, other, world_.spawn(101, 5, "b"), Refusal::kNone, start_);
  ASSERT_TRUE(text.begin_drain());
  const auto tbuf = text.read_buffer();
  std::memcpy(tbuf.data(), "ping\n", 5);
  text.received(5);
  EXPECT_EQ(text.state(), State::kFinishing);
  EXPECT_EQ(other.sent, "");
}

TEST_F(ClientStreamTest, ClosingDetachesTheProcessSoItsOpenSpansAreAbandoned) {
  Connection c(collector_, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(c.attach_error());
  ASSERT_FALSE(c.events({test::start(1, 0, 10)}));
  c.close();
  EXPECT_EQ(c.stream().state(), State::kClosed);
  EXPECT_FALSE(c.stream().handle().has_value());
  const auto doc = report::report_json(*collector_.freeze(), std::nullopt);
  ASSERT_EQ(doc["processes"].size(), 1u);
  EXPECT_EQ(doc["processes"][0]["abandoned"], 1);
}

}  // namespace
}  // namespace steptrace::daemon
