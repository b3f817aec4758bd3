// The library's small owners: UniqueFd (a file descriptor), ThreadKey (a pthread key)
// and ThreadOwner (the thread a single-thread rule belongs to).
#include <fcntl.h>
#include <sys/eventfd.h>

#include <gtest/gtest.h>

#include <thread>
#include <utility>

#include "client/src/thread_key.h"
#include "client/src/thread_owner.h"
#include "proto/unique_fd.h"

namespace steptrace::client {
namespace {

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(UniqueFd, ClosesWhatItOwnsOnceAndMovesOwnership) {
  int raw = -1;
  {
    proto::UniqueFd fd(::eventfd(0, EFD_CLOEXEC));
    ASSERT_TRUE(fd.valid());
    raw = fd.get();
    proto::UniqueFd moved(std::move(fd));
    EXPECT_FALSE(fd.valid());  // a moved-from owner is empty
    EXPECT_EQ(moved.get(), raw);
    proto::UniqueFd assigned;
    assigned = std::move(moved);
    EXPECT_EQ(assigned.get(), raw);
    EXPECT_TRUE(is_open(raw));
  }
  EXPECT_FALSE(is_open(raw));
}

TEST(UniqueFd, ResetClosesTheOldAndReleaseGivesUp) {
  proto::UniqueFd fd(::eventfd(0, EFD_CLOEXEC));
  const int first = fd.get();
  fd.reset(::eventfd(0, EFD_CLOEXEC));
  EXPECT_FALSE(is_open(first));
  const int second = fd.release();
  EXPECT_FALSE(fd.valid());
  fd.reset();
  EXPECT_TRUE(is_open(second));  // released: the caller closes it
  ::close(second);
  EXPECT_FALSE(proto::UniqueFd().valid());
}

int g_destroyed = 0;

TEST(ThreadKey, RunsItsDestructorForThreadsThatSetAValue) {
  g_destroyed = 0;
  ThreadKey key([](void* value) { g_destroyed += *static_cast<int*>(value); });
  ASSERT_TRUE(key.ok());
  int one = 1;
  std::thread([&] { key.set(&one); }).join();
  std::thread([] {}).join();  // no value, no call
  EXPECT_EQ(g_destroyed, 1);
}

TEST(ThreadOwner, FirstCallerOrClaimantOwns) {
  ThreadOwner owner;
  EXPECT_FALSE(owner.is_caller());  // nobody yet
  bool other = true;
  std::thread([&] { other = owner.claim_or_is_caller(); }).join();
  EXPECT_TRUE(other);
  EXPECT_FALSE(owner.claim_or_is_caller());  // that thread owns it
  EXPECT_FALSE(owner.is_caller());
  owner.claim();
  EXPECT_TRUE(owner.is_caller());
  EXPECT_TRUE(owner.claim_or_is_caller());
}

}  // namespace
}  // namespace steptrace::client
