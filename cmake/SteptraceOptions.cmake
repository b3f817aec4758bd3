# Warning and sanitizer flags, applied to our own targets only (no global flags).
add_library(steptrace_warnings INTERFACE)
target_compile_options(steptrace_warnings INTERFACE -Wall -Wextra -Wpedantic
  $<$<BOOL:${STEPTRACE_WERROR}>:-Werror>)

add_library(steptrace_sanitize INTERFACE)
if(STEPTRACE_SANITIZE)
  target_compile_options(steptrace_sanitize INTERFACE
    -fsanitize=${STEPTRACE_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  target_link_options(steptrace_sanitize INTERFACE -fsanitize=${STEPTRACE_SANITIZE})
endif()

# Every internal target links this once: warnings plus sanitizers.
add_library(steptrace_build_flags INTERFACE)
target_link_libraries(steptrace_build_flags INTERFACE steptrace_warnings steptrace_sanitize)
