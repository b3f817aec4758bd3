// The daemon's io-thread rule (daemon/serve/io_thread.h): the first thread that checks
// an io_context owns it; in debug builds the registry, the render worker, the sessions
// and the server assert that they are called on it.
#include "daemon/serve/io_thread.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>

#include <boost/asio/io_context.hpp>

#include "daemon/serve/connections.h"
#include "daemon/serve/render_worker.h"
#include "tests/daemon/daemon_test_util.h"

namespace steptrace::daemon {
namespace {

bool on_io_thread_from_another_thread(boost::asio::io_context& io) {
  bool result = true;
  std::thread([&] { result = on_io_thread(io); }).join();
  return result;
}

TEST(IoThread, TheFirstCallerOwnsTheContext) {
  boost::asio::io_context io;
  EXPECT_TRUE(on_io_thread(io));
  EXPECT_TRUE(on_io_thread(io));
  EXPECT_TRUE(on_io_thread(io.get_executor()));
  EXPECT_FALSE(on_io_thread_from_another_thread(io));
  EXPECT_TRUE(on_io_thread(io));
}

TEST(IoThread, EachContextHasItsOwnThread) {
  boost::asio::io_context mine;
  boost::asio::io_context theirs;
  EXPECT_TRUE(on_io_thread(mine));
  std::thread([&] { EXPECT_TRUE(on_io_thread(theirs)); }).join();
  EXPECT_FALSE(on_io_thread(theirs));
  EXPECT_TRUE(on_io_thread(mine));
}

// What must run on the io thread fails the debug assert on another one.
TEST(IoThreadDeathTest, TheRegistryAndTheRenderWorkerOffTheIoThreadFailTheDebugAssert) {
#ifdef NDEBUG
  GTEST_SKIP() << "NDEBUG: the io-thread asserts are compiled out";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  test::FakeWorld world;
  Collector collector(Limits{}, world.env());
  test::StreamWorld streams(collector);
  boost::asio::io_context io;
  ConnectionRegistry registry(io, streams.shared, streams.config.server_limits);
  RenderWorker renderer(io, collector);
  // The io thread: this one, as in steptraced (the thread that starts the server runs it).
  EXPECT_TRUE(registry.live().empty());
  renderer.submit([](const CollectorView&) { return std::string("ok\n"); }, [](std::string) {});
  EXPECT_DEATH(std::thread([&] { registry.live(); }).join(), "on_io_thread");
  EXPECT_DEATH(std::thread([&] { registry.close_all(); }).join(), "on_io_thread");
  EXPECT_DEATH(std::thread([&] {
                 renderer.submit([](const CollectorView&) { return std::string(); },
                                 [](std::string) {});
               }).join(),
               "on_io_thread");
  renderer.stop();
#endif
}

}  // namespace
}  // namespace steptrace::daemon
