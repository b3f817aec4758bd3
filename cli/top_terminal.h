// The terminal as the interactive `top` needs it, for as long as a TerminalSession
// lives: keys one at a time without echo (Ctrl-C still a signal) from the start, and,
// once the first screen is shown and where escape sequences may be used, the alternate
// screen with the cursor hidden. The destructor puts everything back, so every way out
// restores the terminal: q, a quitting signal, a failed first refresh, an error, and an
// exception on its way up (the CLI's run_top() catches it: an exception nobody catches may end the
// program without unwinding, and then without this destructor).
#pragma once

#include <termios.h>

#include <cstdio>

namespace steptrace::cli {

class TerminalSession {
 public:
  // `in`: the terminal's descriptor for the keys (its modes are changed and restored);
  // `out`: where the escape sequences go (flushed at once).
  TerminalSession(int in, std::FILE* out, bool ansi);
  ~TerminalSession();
  TerminalSession(const TerminalSession&) = delete;
  TerminalSession& operator=(const TerminalSession&) = delete;

  // The alternate screen with the cursor hidden (when ansi), once; before it, what the
  // terminal showed stays (an error before the first screen is read where it was).
  void show();
  // Ctrl-Z: the shell gets its terminal back as it was, and top its own on `fg`.
  void suspend();

 private:
  void enter_keys();
  void leave();
  void write(const char* sequence);

  int in_;
  std::FILE* out_;
  bool ansi_;
  bool have_saved_ = false;
  bool shown_ = false;
  termios saved_{};
};

}  // namespace steptrace::cli
