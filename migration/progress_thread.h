// What the transports with a progress thread of their own share (ucx, device): how that thread
// is stopped.
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>

namespace keel {

// Sets `stop` under `mutex`, wakes `thread` through `wake` and joins it; nothing when the thread
// was never started.
inline void StopProgressThread(std::thread& thread, std::mutex& mutex, bool& stop,
                               std::condition_variable& wake) {
  if (!thread.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex);
    stop = true;
  }
  wake.notify_one();
  thread.join();
}

}  // namespace keel
