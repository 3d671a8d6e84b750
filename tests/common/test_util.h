// Helpers shared by the tests of every module.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "keel/status.hpp"
#include "placement/topology.h"

namespace keel::testing {

// The value of a Result the test expects to succeed; prints the error and aborts otherwise, so
// a setup failure stops the test at once instead of cascading.
template <typename T>
T ValueOrDie(Result<T> result) {
  if (!result.ok()) {
    std::fprintf(stderr, "unexpected error: %s\n", result.status().ToString().c_str());
    std::abort();
  }
  return std::move(result).value();
}

// The same for a Status.
inline void CheckOk(const Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "unexpected error: %s\n", status.ToString().c_str());
    std::abort();
  }
}

// Sets the environment variable `name` to `value` (unsets it for nullopt) while this lives, and
// restores what it was.
class ScopedEnvironment {
 public:
  ScopedEnvironment(std::string name, std::optional<std::string> value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) saved_ = old;
    if (value) {
      ::setenv(name_.c_str(), value->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ScopedEnvironment(const ScopedEnvironment&) = delete;
  ScopedEnvironment& operator=(const ScopedEnvironment&) = delete;
  ~ScopedEnvironment() {
    if (saved_) {
      ::setenv(name_.c_str(), saved_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_;
  std::optional<std::string> saved_;
};

// Runs `work` on a thread of its own and returns what it returns. A call that has not returned
// within `seconds` ends the test program with a message naming `what`, since a blocked thread
// cannot be stopped: a guard against a hang, not a timing.
template <typename Work>
auto WithinSeconds(double seconds, const std::string& what, Work work) -> decltype(work()) {
  std::packaged_task<decltype(work())()> task(std::move(work));
  auto done = task.get_future();
  std::thread(std::move(task)).detach();
  if (done.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) {
    std::fprintf(stderr, "%s did not return within %g s: it hangs\n", what.c_str(), seconds);
    std::_Exit(1);
  }
  return done.get();
}

// A topology of `num_nodes` x `gpus_per_node` ranks with the given link bandwidths (GB/s per GPU,
// one direction; the config's defaults unless named).
inline Topology MakeTopology(int num_nodes, int gpus_per_node, double intra_node_gb_per_s = 400,
                             double inter_node_gb_per_s = 50) {
  TopologyConfig config;
  config.num_nodes = num_nodes;
  config.gpus_per_node = gpus_per_node;
  config.intra_node_gb_per_s = intra_node_gb_per_s;
  config.inter_node_gb_per_s = inter_node_gb_per_s;
  return ValueOrDie(Topology::Create(config));
}

}  // namespace keel::testing
