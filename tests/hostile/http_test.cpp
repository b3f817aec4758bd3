// Slowloris against the HTTP metrics endpoint (issue 15, item 11): connections that send
// their request a byte a second, or nothing at all, must neither keep a scraper from
// being served nor stay open past the header timeout, and the Unix socket keeps
// answering meanwhile. (70 such connections used to make 29 of 30 scrapes fail.)
// And a scraper that does not read its response makes the daemon hold the metrics text,
// which stats counts (memory.http_reply_bytes, issue 26) until the connection lets it go.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;

// The daemon's HttpMetricsServer::kHeaderTimeout, and how late a close may come on a
// loaded CI machine.
constexpr seconds kHeaderTimeout{5};
constexpr seconds kCloseMargin{3};
// What each scrape may take, generous for CI (a scrape of an idle daemon takes ms).
constexpr milliseconds kScrapeDeadline{2000};

constexpr const char* kGetMetrics = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
// The start of a request a slowloris never finishes: a header line it extends forever.
constexpr const char* kSlowStart = "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ";

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
  return left > 0 ? static_cast<int>(left) : 0;
}

// A TCP connection to 127.0.0.1:port made by `deadline`, or -1; `receive_buffer`, when
// not 0, is its SO_RCVBUF (set before connecting, so the window stays that small).
int connect_tcp(int port, Clock::time_point deadline, int receive_buffer = 0) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  if (receive_buffer != 0 &&
      ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer) != 0) {
    ::close(fd);
    return -1;
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof err;
    if (errno != EINPROGRESS || ::poll(&p, 1, remaining_ms(deadline)) != 1 ||
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      ::close(fd);
      return -1;
    }
  }
  return fd;
}

bool send_all(int fd, const std::string& data) {
  return ::send(fd, data.data(), data.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(data.size());
}

// Reads until the peer closes or `deadline`; `closed` says which came first.
std::string read_until_close(int fd, Clock::time_point deadline, bool* closed) {
  std::string reply;
  char buf[65536];
  *closed = false;
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, remaining_ms(deadline)) <= 0) return reply;
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) {  // EOF, or a reset (the daemon closed with our bytes unread)
      *closed = true;
      return reply;
    }
    reply.append(buf, static_cast<std::size_t>(n));
  }
}

struct Scrape {
  bool done = false;  // connected, and the reply ended within the deadline
  std::string reply;
};

Scrape scrape(int port, const std::string& request = kGetMetrics) {
  const auto deadline = Clock::now() + kScrapeDeadline;
  Scrape out;
  const int fd = connect_tcp(port, deadline);
  if (fd < 0) return out;
  if (send_all(fd, request)) out.reply = read_until_close(fd, deadline, &out.done);
  ::close(fd);
  return out;
}

// Reads one response whose header has a Content-Length, whole, by `deadline`: "" when
// the peer closed or the deadline passed first.
std::string read_response(int fd, Clock::time_point deadline) {
  std::string reply;
  char buf[65536];
  std::size_t want = std::string::npos;  // header + body, once the header is in
  while (reply.size() < want) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, remaining_ms(deadline)) <= 0) return "";
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) return "";
    reply.append(buf, static_cast<std::size_t>(n));
    const std::size_t end = reply.find("\r\n\r\n");
    const std::size_t length = reply.find("Content-Length: ");
    if (want == std::string::npos && end != std::string::npos && length < end) {
      want = end + 4 + std::strtoull(reply.c_str() + length + 16, nullptr, 10);
    }
  }
  return reply;
}

// The size of a whole GET /metrics reply, 0 when it could not be read.
std::size_t metrics_size(int port) {
  const auto deadline = Clock::now() + seconds(30);
  const int fd = connect_tcp(port, deadline);
  if (fd < 0) return 0;
  bool closed = false;
  std::string reply;
  if (send_all(fd, kGetMetrics)) reply = read_until_close(fd, deadline, &closed);
  ::close(fd);
  return closed ? reply.size() : 0;
}

// The kernel's largest TCP send buffer (net.ipv4.tcp_wmem's third figure).
std::size_t max_send_buffer() {
  std::ifstream in("/proc/sys/net/ipv4/tcp_wmem");
  std::size_t low = 0, initial = 0, high = 0;
  return in >> low >> initial >> high ? high : std::size_t{4} << 20;
}

// Client processes that hold their connections, killed at the end of the test.
struct Holders {
  std::vector<pid_t> pids;
  Holders() = default;
  Holders(const Holders&) = delete;
  Holders& operator=(const Holders&) = delete;
  ~Holders() {
    for (const pid_t pid : pids) {
      ::kill(pid, SIGKILL);
      wait_or_kill(pid, 10000);
    }
  }
};

// Slow clients: each connection either sent nothing or sent kSlowStart and adds a byte
// every second (from a thread of their own) until the daemon closes it.
class Slowloris {
 public:
  explicit Slowloris(int port) : port_(port) {
    trickler_ = std::thread([this] {
      while (!stop_) {
        {
          std::lock_guard lock(mu_);
          for (Conn& c : conns_) {
            if (c.trickle && !c.send_failed) c.send_failed = !send_all(c.fd, "a");
          }
        }
        for (int i = 0; i < 10 && !stop_; ++i) std::this_thread::sleep_for(milliseconds(100));
      }
    });
  }
  ~Slowloris() {
    stop_ = true;
    trickler_.join();
    for (const Conn& c : conns_) ::close(c.fd);
  }
  Slowloris(const Slowloris&) = delete;
  Slowloris& operator=(const Slowloris&) = delete;

  // Opens one more; false when the connection could not be made.
  bool open(bool trickle) {
    const int fd = connect_tcp(port_, Clock::now() + seconds(2));
    if (fd < 0) return false;
    if (trickle && !send_all(fd, kSlowStart)) {
      ::close(fd);
      return false;
    }
    std::lock_guard lock(mu_);
    conns_.push_back(Conn{fd, trickle, Clock::now()});
    return true;
  }

  // How many the daemon has closed so far (a read sees EOF or a reset).
  std::size_t closed_now() {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    for (Conn& c : conns_) n += poll_closed(c) ? 1 : 0;
    return n;
  }

  // Waits until every connection is closed or its open time + timeout + margin passed;
  // returns the ones still open then. `earliest` gets the shortest time a connection
  // lived (from its open to the close seen here).
  std::size_t wait_all_closed(Clock::duration* earliest = nullptr) {
    const auto patience = kHeaderTimeout + kCloseMargin;
    std::size_t open = 0;
    Clock::duration shortest = Clock::duration::max();
    std::lock_guard lock(mu_);
    for (Conn& c : conns_) {
      while (!poll_closed(c) && Clock::now() < c.opened + patience) {
        pollfd p{c.fd, POLLIN, 0};
        ::poll(&p, 1, std::min(remaining_ms(c.opened + patience), 100));
      }
      if (!c.closed) {
        ++open;
      } else {
        shortest = std::min(shortest, c.closed_at - c.opened);
      }
    }
    if (earliest != nullptr) *earliest = shortest;
    return open;
  }

  std::size_t size() {
    std::lock_guard lock(mu_);
    return conns_.size();
  }

 private:
  struct Conn {
    int fd;
    bool trickle;
    Clock::time_point opened;
    bool send_failed = false;
    bool closed = false;
    Clock::time_point closed_at{};
  };

  // Non-blocking: has the daemon closed `c`? (Drains whatever it sent, e.g. a 400.)
  static bool poll_closed(Conn& c) {
    char buf[4096];
    while (!c.closed) {
      const ssize_t n = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (n < 0 && errno == EINTR) continue;
      c.closed = true;
      c.closed_at = Clock::now();
    }
    return c.closed;
  }

  int port_;
  std::mutex mu_;
  std::vector<Conn> conns_;
  std::atomic<bool> stop_{false};
  std::thread trickler_;
};

class HostileHttpTest : public ::testing::Test {
 protected:
  HostileHttpTest()
      : port_(free_port()),
        daemon_(dir_.file("d.sock"), {"--metrics-listen", "127.0.0.1:" + std::to_string(port_)}) {}

  TempDir dir_;
  int port_;
  DaemonProcess daemon_;
};

TEST_F(HostileHttpTest, ScrapesAreServedWhileSlowAndSilentConnectionsPileUp) {
  ASSERT_TRUE(daemon_.start()) << daemon_.log();
  Slowloris attack(port_);
  // 100 at once (more than the daemon's whole connection cap), half of them trickling.
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(attack.open(i % 2 == 1)) << i;
  // Every scrape meets fresh slow connections too, so each must take the place of one.
  int served = 0;
  std::string failure;
  for (int i = 0; i < 30; ++i) {
    ASSERT_TRUE(attack.open(false));
    ASSERT_TRUE(attack.open(true));
    const Scrape s = scrape(port_);
    const bool ok = s.done && s.reply.rfind("HTTP/1.1 200", 0) == 0 &&
                    s.reply.find("\nsteptrace_connections_accepted_total ") != std::string::npos;
    if (ok) {
      ++served;
    } else if (failure.empty()) {
      failure = "scrape " + std::to_string(i) + (s.done ? " answered: " : " timed out after: ") +
                s.reply.substr(0, 300);
    }
    if (i % 10 == 0) {
      EXPECT_EQ(command(daemon_.socket(), "ping", 2000), "pong\n");
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_EQ(served, 30) << failure << "\n" << daemon_.log();
  // The attack was still on: the daemon had not simply closed every slow connection.
  EXPECT_LT(attack.closed_now(), attack.size());
  EXPECT_EQ(command(daemon_.socket(), "ping", 2000), "pong\n");

  // None outlives the header timeout, whether it trickled or stayed silent.
  EXPECT_EQ(attack.wait_all_closed(), 0u) << daemon_.log();
  EXPECT_EQ(command(daemon_.socket(), "ping", 2000), "pong\n");
  // Logged, but rate-limited: not one line per connection.
  const std::string log = daemon_.log();
  EXPECT_NE(log.find("HTTP metrics: "), std::string::npos) << log;
  // And counted where operators look: stats and the metrics themselves.
  const json stats = json::parse(command(daemon_.socket(), "stats --json").value_or("{}"));
  const json& http = stats["http"];
  EXPECT_GE(http.value("responses", 0), 30) << stats.dump();
  EXPECT_GE(http.value("accepted", 0), 130) << stats.dump();  // 100 slow + 30 scrapes
  EXPECT_GE(http.value("evicted", 0) + http.value("header_timeouts", 0), 100) << stats.dump();
  const Scrape after = scrape(port_);
  EXPECT_NE(after.reply.find("steptrace_http_connections_total{outcome=\"header_timeout\"}"),
            std::string::npos);
  EXPECT_EQ(daemon_.stop(), 0) << daemon_.log();
}

TEST_F(HostileHttpTest, SlowIdleAndKeptAliveConnectionsAreClosedAtTheHeaderTimeout) {
  ASSERT_TRUE(daemon_.start()) << daemon_.log();
  Slowloris attack(port_);
  const auto opened = Clock::now();  // before the first: every deadline is after opened + 5 s
  // Few enough that none is evicted: each must be closed by its deadline alone.
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(attack.open(i % 2 == 1)) << i;

  // A scraper that keeps its connection alive after a response and then goes quiet.
  const int keep = connect_tcp(port_, Clock::now() + seconds(2));
  ASSERT_GE(keep, 0);
  ASSERT_TRUE(send_all(keep, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
  const auto answered = Clock::now();
  std::string reply;
  bool closed = false;
  const auto first = Clock::now() + seconds(2);
  while (reply.find("\r\n\r\n") == std::string::npos && !closed && Clock::now() < first) {
    char buf[65536];
    pollfd p{keep, POLLIN, 0};
    if (::poll(&p, 1, remaining_ms(first)) != 1) break;
    const ssize_t n = ::recv(keep, buf, sizeof buf, 0);
    if (n <= 0) closed = true;
    if (n > 0) reply.append(buf, static_cast<std::size_t>(n));
  }
  EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << reply;
  EXPECT_FALSE(closed);

  // Still connected a little before the timeout (nothing was evicted or cut early)...
  std::this_thread::sleep_until(opened + kHeaderTimeout - milliseconds(1500));
  EXPECT_EQ(attack.closed_now(), 0u) << daemon_.log();
  // ...and served meanwhile, ping included.
  const Scrape s = scrape(port_);
  EXPECT_TRUE(s.done);
  EXPECT_EQ(s.reply.rfind("HTTP/1.1 200", 0), 0u) << s.reply.substr(0, 300);
  EXPECT_EQ(command(daemon_.socket(), "ping", 2000), "pong\n");

  // ...then closed by the timeout, each one.
  Clock::duration shortest{};
  EXPECT_EQ(attack.wait_all_closed(&shortest), 0u) << daemon_.log();
  EXPECT_GE(shortest, kHeaderTimeout - milliseconds(500));
  // The kept-alive connection too, after the rest of its response.
  read_until_close(keep, answered + kHeaderTimeout + kCloseMargin, &closed);
  EXPECT_TRUE(closed) << "an idle keep-alive connection stayed open";
  ::close(keep);
  // The daemon logs it right after it closed the socket, which the attack may see first
  // (under a sanitizer it often does): wait for the line, boundedly.
  const auto logged_by = Clock::now() + seconds(5);
  while (daemon_.log().find("sent no complete request in 5 s") == std::string::npos &&
         Clock::now() < logged_by) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_NE(daemon_.log().find("sent no complete request in 5 s"), std::string::npos)
      << daemon_.log();
  EXPECT_EQ(daemon_.stop(), 0) << daemon_.log();
}

// Issue 26: the metrics text a scrape waits to write is heap the daemon holds; stats
// counts it (memory.http_reply_bytes, and so memory.accounted_bytes) from the render until
// the connection lets it go, and no longer: a keep-alive scraper that read its response
// holds nothing while it stays connected.
TEST_F(HostileHttpTest, MetricsTextsHeldForUnreadResponsesAreCountedUntilLetGo) {
  ASSERT_TRUE(daemon_.start()) << daemon_.log();
  // A figure of `stats --json` (in its "memory" object unless told), or ~0 when absent.
  const auto memory = [this](const char* key, const char* group = "memory") -> std::uint64_t {
    json s = json::parse(command(daemon_.socket(), "stats --json").value_or("{}"));
    if (*group != '\0') s = s.contains(group) ? s[group] : json();
    return s.contains(key) ? s[key].get<std::uint64_t>() : ~std::uint64_t{0};
  };
  const auto wait_until = [](const std::function<bool()>& done) {
    const auto by = Clock::now() + seconds(8);  // within the daemon's 10 s write timeout
    while (!done() && Clock::now() < by) std::this_thread::sleep_for(milliseconds(20));
    return done();
  };
  // A table whose metrics text the socket buffers cannot take while nobody reads: live
  // processes of 1,024 custom steps each, until it is twice the largest send buffer.
  Holders holders;
  const std::size_t wanted = 2 * max_send_buffer();
  std::size_t body = 0;
  for (int i = 0; i < 32 && body <= wanted; ++i) {
    const std::string name = "fill" + std::to_string(i);
    holders.pids.push_back(
        spawn_process({RAW_CLIENT_BIN, daemon_.socket(), "good", "--threads", "1", "--pairs", "1",
                       "--custom", name, "--customs", "1024", "--hold-ms", "120000"}));
    ASSERT_TRUE(wait_until([&] { return memory("custom_steps", "") >= 1024u * (i + 1); }));
    body = metrics_size(port_);
  }
  ASSERT_GT(body, wanted);
  EXPECT_EQ(memory("http_reply_bytes"), 0u);  // every scrape so far was read whole

  // A scraper that asks and does not read, through a small receive window.
  const int stalled = connect_tcp(port_, Clock::now() + seconds(2), 4096);
  ASSERT_GE(stalled, 0);
  ASSERT_TRUE(send_all(stalled, kGetMetrics));
  std::uint64_t held = 0;
  ASSERT_TRUE(wait_until([&] { return (held = memory("http_reply_bytes")) != 0; }))
      << daemon_.log();
  EXPECT_GE(held, body * 9 / 10);  // the text, once
  EXPECT_LT(held, body * 2);
  const json s = json::parse(command(daemon_.socket(), "stats --json").value_or("{}"));
  const json& m = s["memory"];
  EXPECT_EQ(m["http_reply_bytes"], held);
  EXPECT_EQ(m["accounted_bytes"].get<std::uint64_t>(),
            m["state_bytes_charged"].get<std::uint64_t>() +
                m["view_copy_bytes"].get<std::uint64_t>() +
                s["flight_recorder"]["bytes"].get<std::uint64_t>() +
                m["reply_bytes_pending"].get<std::uint64_t>() + held)
      << s.dump();

  // A keep-alive scraper that reads its response: its text is let go once written, while
  // the connection stays open.
  const int kept = connect_tcp(port_, Clock::now() + seconds(2));
  ASSERT_GE(kept, 0);
  ASSERT_TRUE(send_all(kept, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
  const std::string reply = read_response(kept, Clock::now() + seconds(30));
  EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << reply.substr(0, 300);
  EXPECT_TRUE(wait_until([&] { return memory("http_reply_bytes") == held; }))
      << memory("http_reply_bytes") << " held, " << held << " for the stalled scrape";

  // The stalled scraper closes: its text is let go at once (not at the write timeout).
  ::close(stalled);
  EXPECT_TRUE(wait_until([&] { return memory("http_reply_bytes") == 0; })) << daemon_.log();
  const json after = json::parse(command(daemon_.socket(), "stats --json").value_or("{}"));
  EXPECT_EQ(after["http"]["write_timeouts"], 0) << after.dump();
  EXPECT_EQ(after["http"]["idle_closed"], 0) << after.dump();
  char byte = 0;
  EXPECT_EQ(::recv(kept, &byte, 1, MSG_DONTWAIT), -1) << "the kept-alive connection was closed";
  ::close(kept);
  EXPECT_EQ(daemon_.stop(), 0) << daemon_.log();
}

}  // namespace
}  // namespace steptrace::testing
