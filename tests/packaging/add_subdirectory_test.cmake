# ctest packaging.add_subdirectory (cmake -P): the project in add_subdirectory/, which
# pulls steptrace in with add_subdirectory and the daemon, tests, benchmarks and examples
# OFF, is configured and built (-j2; only the client library and one C program) in a
# fresh temporary directory, and its program run. Checked: the program's output (the
# version from <steptrace/version.h>), that nothing but the client was configured, and
# that steptrace adds no install rule and no CPack package to a project that embeds it.
# Defined by tests/packaging/CMakeLists.txt: SOURCE_DIR, VERSION, GENERATOR, MAKE_PROGRAM,
# C_COMPILER, CXX_COMPILER, BUILD_TYPE, WERROR.
cmake_minimum_required(VERSION 3.25)

foreach(var SOURCE_DIR VERSION GENERATOR C_COMPILER CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "add_subdirectory_test.cmake: -D${var}=... is required")
  endif()
endforeach()

set(tmp_base "$ENV{TMPDIR}")
if(tmp_base STREQUAL "")
  set(tmp_base /tmp)
endif()
string(RANDOM LENGTH 10 suffix)
set(tmp "${tmp_base}/steptrace-subdir-${suffix}")
file(MAKE_DIRECTORY "${tmp}")
set(build "${tmp}/build")

function(fail what)
  file(REMOVE_RECURSE "${tmp}")
  message(FATAL_ERROR "packaging.add_subdirectory: ${what}")
endfunction()

# Runs a command; fails the test with its output unless it exits 0.
function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    fail("${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

set(configure_args -S "${SOURCE_DIR}/tests/packaging/add_subdirectory" -B "${build}"
  -G "${GENERATOR}" "-DCMAKE_C_COMPILER=${C_COMPILER}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
  "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}" "-DSTEPTRACE_SOURCE_DIR=${SOURCE_DIR}"
  "-DSTEPTRACE_WERROR=${WERROR}")
if(MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
step("configure" "${CMAKE_COMMAND}" ${configure_args})
step("build" "${CMAKE_COMMAND}" --build "${build}" -j 2)

# Only the client: no daemon, CLI, tests, benchmarks or examples configured.
foreach(dir daemon cli tests bench examples)
  if(EXISTS "${build}/steptrace/${dir}")
    fail("${dir}/ was configured although add_subdirectory/CMakeLists.txt turned it off")
  endif()
endforeach()
if(NOT EXISTS "${build}/steptrace/include/steptrace/version.h")
  fail("no generated steptrace/include/steptrace/version.h in the build tree")
endif()
# STEPTRACE_INSTALL is OFF when steptrace is not the top-level project.
if(EXISTS "${build}/CPackConfig.cmake")
  fail("steptrace set up CPack in a project that embeds it")
endif()
step("install" "${CMAKE_COMMAND}" --install "${build}" --prefix "${tmp}/prefix")
file(GLOB_RECURSE installed LIST_DIRECTORIES false "${tmp}/prefix/*")
if(installed)
  fail("steptrace installed files from a project that embeds it: ${installed}")
endif()

step("run subdir_consumer" "${build}/subdir_consumer" "${tmp}/absent.sock")
if(NOT step_output STREQUAL "steptrace ${VERSION}\n")
  fail("subdir_consumer printed '${step_output}', expected 'steptrace ${VERSION}'")
endif()

file(REMOVE_RECURSE "${tmp}")
message(STATUS "packaging.add_subdirectory: built the client only, ran subdir_consumer: "
               "steptrace ${VERSION}")
