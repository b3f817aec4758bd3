# Every external dependency, found here and only here (included once from the top-level
# CMakeLists.txt, after the options), each only when a part that needs it is built:
#
#   client library        Threads
#   daemon, CLI           Boost (Asio), spdlog, libsystemd (pkg-config), CLI11,
#                         nlohmann_json, Threads      (STEPTRACE_BUILD_DAEMON)
#   examples              CLI11, nlohmann_json         (STEPTRACE_BUILD_EXAMPLES)
#   tests                 GTest/GMock, nlohmann_json, python3  (STEPTRACE_BUILD_TESTS)
#   benchmarks            Google Benchmark, nlohmann_json, with the daemon they measure
#                         (STEPTRACE_BUILD_BENCH and STEPTRACE_BUILD_DAEMON)
#
# A client-only build (all four OFF) needs nothing but a C/C++ compiler and pthreads.

find_package(Threads REQUIRED)

if(STEPTRACE_BUILD_DAEMON)
  find_package(Boost 1.74 REQUIRED)
  find_package(spdlog REQUIRED)
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(SYSTEMD REQUIRED IMPORTED_TARGET libsystemd)
endif()

if(STEPTRACE_BUILD_DAEMON OR STEPTRACE_BUILD_EXAMPLES)
  find_package(CLI11 REQUIRED)
endif()

if(STEPTRACE_BUILD_DAEMON OR STEPTRACE_BUILD_EXAMPLES OR STEPTRACE_BUILD_TESTS
   OR (STEPTRACE_BUILD_BENCH AND STEPTRACE_BUILD_DAEMON))
  find_package(nlohmann_json 3.10 REQUIRED)
endif()

if(STEPTRACE_BUILD_TESTS)
  find_package(GTest REQUIRED)
  # The Python binding's tests and the packaging tests are Python scripts.
  find_package(Python3 REQUIRED COMPONENTS Interpreter)
endif()

if(STEPTRACE_BUILD_BENCH AND STEPTRACE_BUILD_DAEMON)
  find_package(benchmark REQUIRED)
endif()
