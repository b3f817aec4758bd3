# steptrace_add_test(NAME name SOURCES a.cpp ... [LIBS lib ...] [LABELS l ...])
# One GoogleTest executable, discovered test by test.
# (GTest itself is found by SteptraceDependencies.cmake.)
include(GoogleTest)
function(steptrace_add_test)
  cmake_parse_arguments(ARG "" "NAME" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${ARG_NAME} ${ARG_SOURCES})
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gmock GTest::gtest_main
    steptrace_build_flags steptrace_test_support)
  # gtest_discover_tests cannot pass a list-valued property through its generated
  # script, so the labels travel as one comma-joined label; `ctest -L ledger` matches
  # it all the same (labels are selected by regular expression).
  string(REPLACE ";" "," labels "${ARG_LABELS}")
  gtest_discover_tests(${ARG_NAME}
    DISCOVERY_TIMEOUT 60
    PROPERTIES LABELS "${labels}" TIMEOUT 300)
endfunction()

# An uninstrumented interpreter (python3) that loads the ASan-built libsteptrace needs
# the ASan runtime preloaded; empty when the build is not sanitized.
set(STEPTRACE_LIBASAN "")
if(STEPTRACE_SANITIZE MATCHES "address")
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libasan.so
    OUTPUT_VARIABLE STEPTRACE_LIBASAN OUTPUT_STRIP_TRAILING_WHITESPACE)
endif()
