// The daemon's side of systemd: socket activation (LISTEN_FDS) and Type=notify
// readiness. Thin wrappers over libsystemd's sd-daemon; every call is harmless when the
// daemon was not started by systemd (no LISTEN_FDS, no NOTIFY_SOCKET).
#pragma once

#include <optional>
#include <string>

namespace steptrace::daemon {

// What systemd passed us.
struct ActivationSocket {
  int fd = -1;        // set when exactly one AF_UNIX stream socket was passed
  std::string error;  // set when sockets were passed but not the one we can use
};

// Checks LISTEN_FDS (and unsets it so children do not inherit it). Empty result (fd -1,
// no error) when systemd passed nothing.
ActivationSocket systemd_activation_socket();

void notify_ready(const std::string& status);
void notify_status(const std::string& status);
void notify_stopping();

}  // namespace steptrace::daemon
