#include "daemon/serve/systemd_integration.h"

#include <sys/socket.h>
#include <systemd/sd-daemon.h>

#include <cstring>

namespace steptrace::daemon {

ActivationSocket systemd_activation_socket() {
  ActivationSocket result;
  const int n = sd_listen_fds(1);
  if (n == 0) return result;
  if (n < 0) {
    result.error = std::string("systemd socket activation: ") + std::strerror(-n);
    return result;
  }
  if (n != 1) {
    result.error = "systemd passed " + std::to_string(n) +
                   " sockets; steptraced expects exactly one AF_UNIX stream socket";
    return result;
  }
  const int fd = SD_LISTEN_FDS_START;
  if (sd_is_socket_unix(fd, SOCK_STREAM, /*listening=*/1, nullptr, 0) <= 0) {
    result.error = "the socket systemd passed is not a listening AF_UNIX stream socket";
    return result;
  }
  result.fd = fd;
  return result;
}

void notify_ready(const std::string& status) {
  const std::string message = "READY=1\nSTATUS=" + status;
  sd_notify(0, message.c_str());
}

void notify_status(const std::string& status) {
  const std::string message = "STATUS=" + status;
  sd_notify(0, message.c_str());
}

void notify_stopping() { sd_notify(0, "STOPPING=1\nSTATUS=stopping"); }

}  // namespace steptrace::daemon
