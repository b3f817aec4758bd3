// The render worker's queue policy (render_worker.h), without threads or Asio so that a
// unit test can drive it: jobs wait per owner (a peer uid, the HTTP scrapers, the
// daemon itself), FIFO within an owner; owners are served round-robin, at most one job
// of an owner in progress at a time. One tenant asking for reports on 200 connections
// then waits for its own reports, while any other owner's next job runs after at most
// one job of each owner ahead of it in the round.
//
// Data flow: push(owner, item) -> take_round(max): the front item of each owner that has
// one waiting and none in progress, in owner order starting after the owner served last,
// each marked in progress -> done(owner) when its job finished.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace steptrace::daemon {

// Whose turn a render job takes.
struct RenderOwner {
  enum class Kind : std::uint8_t {
    kUid,     // a text command's peer uid (SO_PEERCRED)
    kHttp,    // the HTTP scrapers: TCP has no peer uid, so all of them are one owner
    kDaemon,  // the daemon's own (periodic snapshots)
  };
  Kind kind = Kind::kDaemon;
  std::uint32_t uid = 0;  // kUid only

  static constexpr RenderOwner of_uid(std::uint32_t uid) { return {Kind::kUid, uid}; }
  static constexpr RenderOwner http() { return {Kind::kHttp, 0}; }
  static constexpr RenderOwner daemon() { return {Kind::kDaemon, 0}; }
  auto operator<=>(const RenderOwner&) const = default;
  std::string describe() const {
    switch (kind) {
      case Kind::kUid:
        return "uid " + std::to_string(uid);
      case Kind::kHttp:
        return "HTTP scrapes";
      case Kind::kDaemon:
        break;
    }
    return "the daemon";
  }
};

template <typename Item>
class RenderQueue {
 public:
  void push(RenderOwner owner, Item item) {
    lanes_[owner].items.push_back(std::move(item));
    ++waiting_;
  }

  // The next round: at most `max` items, the front one of each owner with an item waiting
  // and none in progress, round-robin; each owner taken is in progress until done().
  std::vector<std::pair<RenderOwner, Item>> take_round(std::size_t max) {
    std::vector<std::pair<RenderOwner, Item>> round;
    if (lanes_.empty() || max == 0) return round;
    auto it = last_ ? lanes_.upper_bound(*last_) : lanes_.begin();
    for (std::size_t seen = 0; seen < lanes_.size() && round.size() < max; ++seen, ++it) {
      if (it == lanes_.end()) it = lanes_.begin();
      Lane& lane = it->second;
      if (lane.busy || lane.items.empty()) continue;
      lane.busy = true;
      ++in_progress_;
      --waiting_;
      round.emplace_back(it->first, std::move(lane.items.front()));
      lane.items.pop_front();
      last_ = it->first;
    }
    return round;
  }

  // The owner's job in progress finished: its next one may be taken.
  void done(RenderOwner owner) {
    const auto it = lanes_.find(owner);
    if (it == lanes_.end() || !it->second.busy) return;
    it->second.busy = false;
    --in_progress_;
    if (it->second.items.empty()) lanes_.erase(it);  // owners come and go: keep the map small
  }

  // True when take_round() would give something (with `pred`: an item `pred` accepts).
  bool ready() const {
    return ready([](const Item&) { return true; });
  }
  template <typename Pred>
  bool ready(Pred pred) const {
    for (const auto& [owner, lane] : lanes_) {
      if (!lane.busy && !lane.items.empty() && pred(lane.items.front())) return true;
    }
    return false;
  }
  std::size_t waiting() const { return waiting_; }
  std::size_t in_progress() const { return in_progress_; }
  std::size_t waiting(RenderOwner owner) const {
    const auto it = lanes_.find(owner);
    return it == lanes_.end() ? 0 : it->second.items.size();
  }
  void clear() {
    lanes_.clear();
    last_.reset();
    waiting_ = 0;
    in_progress_ = 0;
  }

 private:
  struct Lane {
    std::deque<Item> items;
    bool busy = false;  // one of its items is in progress
  };
  std::map<RenderOwner, Lane> lanes_;  // owners with an item waiting or in progress
  std::optional<RenderOwner> last_;    // served last: the next round starts after it
  std::size_t waiting_ = 0;
  std::size_t in_progress_ = 0;
};

}  // namespace steptrace::daemon
