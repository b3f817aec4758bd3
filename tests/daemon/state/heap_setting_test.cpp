// The daemon's heap setting (daemon/state/charge.h, heap::return_big_blocks_when_freed):
// once a big block was freed, the next big one is still a mapping of its own, unmapped
// when freed. glibc's dynamic threshold would have risen to the first block's size and
// grown the heap for the next, where it stays when freed. A binary of its own: malloc
// serves a block from a free chunk of the heap before it considers a mapping, so the
// heap must be this process's fresh one, not what other tests left.
#include <malloc.h>

#include <cstddef>
#include <cstdlib>

#include <gtest/gtest.h>

#include "daemon/state/charge.h"
#include "tests/support/sanitizer.h"

namespace steptrace::daemon::test {
namespace {

// mallopt and mallinfo2 are glibc's allocator's; ASan's replaces it.
constexpr bool kGlibcMalloc = !steptrace::testing::kAddressSanitizer;

// NOLINTBEGIN(cppcoreguidelines-no-malloc): the allocator itself is what is tested.
TEST(HeapSettingTest, AfterABigBlockIsFreedTheNextBigBlockIsStillMappedAlone) {
  if (!kGlibcMalloc) GTEST_SKIP() << "mallopt and mallinfo2 are glibc's allocator's";
  ASSERT_TRUE(heap::return_big_blocks_when_freed());
  void* first = std::malloc(std::size_t{8} << 20);
  ASSERT_NE(first, nullptr);
  std::free(first);
  const std::size_t mapped_before = ::mallinfo2().hblks;
  void* next = std::malloc(std::size_t{4} << 20);
  ASSERT_NE(next, nullptr);
  const std::size_t mapped_with = ::mallinfo2().hblks;
  std::free(next);
  EXPECT_EQ(mapped_with, mapped_before + 1);
  EXPECT_EQ(::mallinfo2().hblks, mapped_before);  // and unmapped when freed
}
// NOLINTEND(cppcoreguidelines-no-malloc)

}  // namespace
}  // namespace steptrace::daemon::test
