// Whether this test binary is built with AddressSanitizer (STEPTRACE_SANITIZE=address),
// known at compile time: GCC defines __SANITIZE_ADDRESS__, Clang answers
// __has_feature(address_sanitizer). Tests use it to give ASan's allocator, shadow memory
// and fake stacks room in their bounds, or to skip what only glibc's malloc can show.
#pragma once

namespace steptrace::testing {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

}  // namespace steptrace::testing
