// Prints the built-in step table (proto/steps.h), one step a line: id, name and 1 for a
// ledger step else 0, tab-separated. python_steps_test.py compares the Python binding
// with it.
#include <cstdio>
#include <string>

#include "proto/steps.h"

int main() {
  for (const steptrace::proto::BuiltinStep& step : steptrace::proto::kBuiltinSteps) {
    const std::string name(step.name);
    std::printf("%u\t%s\t%d\n", step.id, name.c_str(), step.ledger ? 1 : 0);
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}
