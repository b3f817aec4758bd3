// A C++17 user of the installed libsteptrace through <steptrace/steptrace.hpp>:
// `consumer_cpp N` records N Backward spans with an Attention span nested in each (RAII
// Span), waits until the daemon has applied them and prints its pid.
#include <steptrace/steptrace.hpp>

#include <unistd.h>

#include <cstdlib>
#include <iostream>

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 10;
  if (const int rc = steptrace_connect(nullptr); rc != 0) {
    std::cerr << "steptrace_connect: " << rc << "\n";
    return 2;
  }
  for (int i = 0; i < n; ++i) {
    steptrace::Span backward(steptrace::Step::kBackward);
    steptrace::Span attention(steptrace::Step::kAttention);
  }
  if (const int rc = steptrace_flush(10000); rc != 0) {
    std::cerr << "steptrace_flush: " << rc << "\n";
    return 4;
  }
  std::cout << getpid() << std::endl;
  steptrace_shutdown();
  return 0;
}
