// The HTTP server Prometheus scrapes: one thread, non-blocking sockets and poll(), so a client
// that connects and sends nothing, or drips its request a byte at a time, holds one socket and
// never a worker that a scrape waits for (what a thread-per-connection server such as civetweb
// does). It serves one page over HTTP/1.1 on IPv4 and IPv6, one request per connection.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "common/listen_address.h"
#include "keel/status.hpp"

namespace keel {

struct ScrapeServerParams {
  ListenAddress address;
  std::string path = "/metrics";  // GET or HEAD of it (any query) gets the page, others a 404
  // Builds the page for each scrape, on the server thread; may be called while other threads
  // update what it reads. An exception it throws becomes a 500 for that scrape.
  std::function<std::string()> page;
  std::string content_type = "text/plain; version=0.0.4; charset=utf-8";
  // Connections open at once. A client connecting beyond it closes the connection that has
  // waited longest for its request head (or is refused when every connection is being answered),
  // so idle clients can never keep a scrape out.
  int max_connections = 256;
  std::size_t max_request_bytes = 8192;  // a longer request head gets a 431
  // A client has request_timeout from connecting to send its request head, then
  // response_timeout to take the whole response (Prometheus's default scrape_timeout is 10 s).
  std::chrono::milliseconds request_timeout{5000};
  std::chrono::milliseconds response_timeout{10000};
};

class ScrapeServer {
 public:
  // Resolves the address (a host name: its first IPv4 address, else its first IPv6 one), binds
  // it (port 0: a free port), listens and starts the thread. Errors name the address and why
  // it could not be bound (in use, not this host's, needs root).
  static Result<std::unique_ptr<ScrapeServer>> Start(ScrapeServerParams params);
  // Stops the thread and closes every connection.
  ~ScrapeServer();
  ScrapeServer(const ScrapeServer&) = delete;
  ScrapeServer& operator=(const ScrapeServer&) = delete;

  // "127.0.0.1:9400", "[::1]:9400": the numeric address and the port actually bound.
  const std::string& bound_address() const { return bound_address_; }
  int bound_port() const { return bound_port_; }

 private:
  class Loop;
  ScrapeServer() = default;

  std::string bound_address_;
  int bound_port_ = 0;
  std::unique_ptr<Loop> loop_;
};

}  // namespace keel
