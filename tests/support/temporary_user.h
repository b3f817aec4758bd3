// A temporary system user for tests that run clients as other users (CI runs as root):
// made with useradd (no home, no login shell) and removed by the destructor. created() is
// false when useradd failed (not root), and the test says so.
#pragma once

#include <pwd.h>
#include <sys/types.h>

#include <string>
#include <utility>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {

class TemporaryUser {
 public:
  explicit TemporaryUser(std::string name) : name_(std::move(name)) {
    (void)run_process({"/usr/sbin/userdel", name_}, {}, kWaitMs);  // a leftover of a crash
    if (run_process({"/usr/sbin/useradd", "--system", "--no-create-home", "--shell",
                     "/usr/sbin/nologin", name_},
                    {}, kWaitMs) != 0) {
      return;
    }
    const passwd* pw = ::getpwnam(name_.c_str());
    if (pw == nullptr) return;
    uid_ = pw->pw_uid;
    gid_ = pw->pw_gid;
    created_ = true;
  }
  ~TemporaryUser() {
    if (created_) (void)run_process({"/usr/sbin/userdel", name_}, {}, kWaitMs);
  }
  TemporaryUser(const TemporaryUser&) = delete;
  TemporaryUser& operator=(const TemporaryUser&) = delete;

  bool created() const { return created_ && uid_ != 0; }
  const std::string& name() const { return name_; }
  uid_t uid() const { return uid_; }
  gid_t gid() const { return gid_; }

 private:
  static constexpr int kWaitMs = 30000;
  std::string name_;
  uid_t uid_ = 0;
  gid_t gid_ = 0;
  bool created_ = false;
};

}  // namespace steptrace::testing
