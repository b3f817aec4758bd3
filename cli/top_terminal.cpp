#include "cli/top_terminal.h"

#include <signal.h>

namespace steptrace::cli {

TerminalSession::TerminalSession(int in, std::FILE* out, bool ansi)
    : in_(in), out_(out), ansi_(ansi) {
  have_saved_ = ::tcgetattr(in_, &saved_) == 0;
  enter_keys();
}

TerminalSession::~TerminalSession() { leave(); }

void TerminalSession::show() {
  if (shown_) return;
  shown_ = true;
  if (ansi_) write("\x1b[?1049h\x1b[?25l");  // alternate screen, cursor hidden
}

void TerminalSession::suspend() {
  const bool was_shown = shown_;
  leave();
  ::raise(SIGSTOP);
  enter_keys();
  if (was_shown) show();
}

void TerminalSession::enter_keys() {
  if (!have_saved_) return;
  termios raw = saved_;
  raw.c_lflag &= ~static_cast<tcflag_t>(ICANON | ECHO);
  raw.c_cc[VMIN] = 0;
  raw.c_cc[VTIME] = 0;
  ::tcsetattr(in_, TCSANOW, &raw);
}

void TerminalSession::leave() {
  if (shown_) {
    shown_ = false;
    if (ansi_) write("\x1b[?25h\x1b[?1049l");  // cursor shown, main screen back
  }
  if (have_saved_) ::tcsetattr(in_, TCSANOW, &saved_);
}

void TerminalSession::write(const char* sequence) {
  // A reader that went away (EPIPE) or a full disk: nothing more to do about it here.
  std::fputs(sequence, out_);
  std::fflush(out_);
}

}  // namespace steptrace::cli
