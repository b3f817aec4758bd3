# steptrace_add_test(NAME name SOURCES a.cpp ... [LIBS lib ...] [LABELS l ...])
# One GoogleTest executable, discovered test by test.
# (GTest itself is found by SteptraceDependencies.cmake.)
include(GoogleTest)

# steptrace_test_costs(): the COST (expected seconds) of the longest tests, from
# tests/test_costs.cmake, applied to the tests of the calling directory. `ctest -j N`
# starts the costliest first; without this a fresh build tree (CI's clone) has no cost
# data and runs them in declaration order, so a long test started last runs alone at the
# end on one core. The table is read by ctest itself, after the directory's tests are
# defined (gtest_discover_tests defines its tests only then, under names CMake never
# sees): a deferred TEST_INCLUDE_FILES entry, once per directory. Names of tests another
# directory defines, or a configuration leaves out, match nothing and are ignored.
function(steptrace_test_costs)
  get_property(added DIRECTORY PROPERTY STEPTRACE_TEST_COSTS)
  if(NOT added)
    set_property(DIRECTORY PROPERTY STEPTRACE_TEST_COSTS ON)
    cmake_language(DEFER CALL set_property DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES
      "${PROJECT_SOURCE_DIR}/tests/test_costs.cmake")
  endif()
endfunction()
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
  steptrace_test_costs()
endfunction()

# An uninstrumented interpreter (python3) that loads the ASan-built libsteptrace needs
# the ASan runtime preloaded; empty when the build is not sanitized.
set(STEPTRACE_LIBASAN "")
if(STEPTRACE_SANITIZE MATCHES "address")
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libasan.so
    OUTPUT_VARIABLE STEPTRACE_LIBASAN OUTPUT_STRIP_TRAILING_WHITESPACE)
endif()
