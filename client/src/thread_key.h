// A pthread key with one owner: created with its destructor, deleted with the owner.
#pragma once

#include <pthread.h>

namespace steptrace::client {

class ThreadKey {
 public:
  // `destructor` runs at the exit of each thread whose value is not null (pthread_key_create).
  explicit ThreadKey(void (*destructor)(void*)) noexcept
      : ok_(::pthread_key_create(&key_, destructor) == 0) {}
  ~ThreadKey() {
    if (ok_) ::pthread_key_delete(key_);
  }
  ThreadKey(const ThreadKey&) = delete;
  ThreadKey& operator=(const ThreadKey&) = delete;

  // Whether the key exists (creation can fail when the process ran out of keys).
  bool ok() const noexcept { return ok_; }
  // The calling thread's value; nothing when the key does not exist.
  void set(void* value) const noexcept {
    if (ok_) ::pthread_setspecific(key_, value);
  }

 private:
  pthread_key_t key_{};
  bool ok_;
};

}  // namespace steptrace::client
