// ScrapeServer: one thread polls the listening socket, a wake-up eventfd and every connection.
// A connection moves through three stages, each with a deadline: reading its request head,
// writing the response, and draining what the client still sends after our FIN (closing with
// unread input would reset the connection and could cut the response short). No call ever waits
// for one client, so the cost of an idle or slow client is a socket and a few bytes of buffer.
#include "monitor/scrape_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <exception>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "common/file.h"
#include "common/log.h"

namespace keel {
namespace {

using Clock = std::chrono::steady_clock;

// After accept() fails for want of descriptors with no connection to give up, the listening
// socket is left alone this long rather than polled in a busy loop.
constexpr std::chrono::milliseconds kAcceptPause{100};

std::string SystemMessage(int error) { return std::system_category().message(error); }

struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t size = 0;
  int family() const { return storage.ss_family; }
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

// The address to bind: a literal as written; a host name's first IPv4 address, else its first
// IPv6 one (so "localhost" means 127.0.0.1, as it did with civetweb).
Result<SocketAddress> Resolve(const ListenAddress& address) {
  addrinfo hints{};
  hints.ai_family = address.ipv6 ? AF_INET6 : AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(address.port);
  if (int error = getaddrinfo(address.host.c_str(), port.c_str(), &hints, &found); error != 0) {
    return InvalidArgument("cannot resolve host '" + address.host + "': " + gai_strerror(error));
  }
  const addrinfo* chosen = nullptr;
  for (const addrinfo* entry = found; entry != nullptr; entry = entry->ai_next) {
    if (entry->ai_family == AF_INET && (chosen == nullptr || chosen->ai_family != AF_INET)) {
      chosen = entry;
    } else if (entry->ai_family == AF_INET6 && chosen == nullptr) {
      chosen = entry;
    }
  }
  SocketAddress resolved;
  if (chosen != nullptr && chosen->ai_addrlen <= sizeof(resolved.storage)) {
    std::copy_n(reinterpret_cast<const char*>(chosen->ai_addr), chosen->ai_addrlen,
                reinterpret_cast<char*>(&resolved.storage));
    resolved.size = chosen->ai_addrlen;
  }
  freeaddrinfo(found);
  if (resolved.size == 0) {
    return InvalidArgument("host '" + address.host + "' has no IPv4 or IPv6 address");
  }
  return resolved;
}

// "127.0.0.1:9400" or "[::1]:9400" of a bound socket.
Result<std::string> BoundAddress(int fd, int* port) {
  SocketAddress bound;
  bound.size = sizeof(bound.storage);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&bound.storage), &bound.size) != 0) {
    return IoError("getsockname: " + SystemMessage(errno));
  }
  char text[INET6_ADDRSTRLEN] = {};
  if (bound.family() == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(bound.storage);
    inet_ntop(AF_INET6, &v6.sin6_addr, text, sizeof text);
    *port = ntohs(v6.sin6_port);
    return "[" + std::string(text) + "]:" + std::to_string(*port);
  }
  const auto& v4 = reinterpret_cast<const sockaddr_in&>(bound.storage);
  inet_ntop(AF_INET, &v4.sin_addr, text, sizeof text);
  *port = ntohs(v4.sin_port);
  return std::string(text) + ":" + std::to_string(*port);
}

std::string BindProblem(int error) {
  switch (error) {
    case EADDRINUSE:
      return "the port is in use";
    case EADDRNOTAVAIL:
      return "the address is not one of this host's";
    case EACCES:
      return "ports below 1024 need root";
    default:
      return "cannot bind";
  }
}

// The request head ends at its first empty line; `from` is where the last read began, less the
// three bytes an end split across reads can start with.
bool HeadComplete(std::string_view received, size_t from) {
  return received.find("\n\n", from) != std::string_view::npos ||
         received.find("\n\r\n", from) != std::string_view::npos;
}

}  // namespace

class ScrapeServer::Loop {
 public:
  Loop(ScrapeServerParams params, Descriptor listener, Descriptor wake)
      : params_(std::move(params)),
        listener_(std::move(listener)),
        wake_(std::move(wake)),
        thread_([this] { Run(); }) {}

  ~Loop() {
    const uint64_t one = 1;
    if (write(wake_.get(), &one, sizeof one) != sizeof one) {
      KEEL_LOG_ERROR("metrics server: cannot wake the server thread: %s",
                     SystemMessage(errno).c_str());
    }
    thread_.join();
  }

 private:
  enum class Stage { kReadingHead, kWriting, kDraining, kClosed };
  struct Connection {
    Descriptor socket;
    Stage stage = Stage::kReadingHead;
    Clock::time_point opened;
    Clock::time_point deadline;
    std::string received;  // the request head so far
    std::string response;  // while writing
    size_t sent = 0;
  };

  void Run() {
    try {
      Serve();
    } catch (const std::exception& error) {
      // Only allocation can throw here; the trainer goes on without its exporter.
      KEEL_LOG_ERROR("metrics server stopped: %s", error.what());
    }
  }

  void Serve() {
    std::vector<pollfd> polled;
    for (;;) {
      const Clock::time_point now = Clock::now();
      for (Connection& connection : connections_) {
        if (connection.deadline <= now) Close(connection);
      }
      std::erase_if(connections_, [](const Connection& c) { return c.stage == Stage::kClosed; });

      const bool accepting = now >= accept_paused_until_;
      Clock::time_point wake_at = accepting ? Clock::time_point::max() : accept_paused_until_;
      polled.clear();
      polled.push_back({wake_.get(), POLLIN, 0});
      polled.push_back({accepting ? listener_.get() : -1, POLLIN, 0});
      for (const Connection& connection : connections_) {
        const short events = connection.stage == Stage::kWriting ? POLLOUT : POLLIN;
        polled.push_back({connection.socket.get(), events, 0});
        wake_at = std::min(wake_at, connection.deadline);
      }
      if (poll(polled.data(), polled.size(), TimeoutMs(now, wake_at)) < 0) {
        if (errno == EINTR) continue;
        KEEL_LOG_ERROR("metrics server stopped: poll: %s", SystemMessage(errno).c_str());
        return;
      }
      if (polled[0].revents != 0) return;
      const Clock::time_point after = Clock::now();
      for (size_t i = 0; i < connections_.size(); ++i) {
        if (polled[i + 2].revents != 0) Advance(connections_[i], after);
      }
      if (polled[1].revents != 0) Accept(after);
    }
  }

  // Milliseconds poll() may sleep until `wake_at`: rounded up, so a deadline is never polled
  // for in a busy loop; -1 (no limit) when nothing has a deadline.
  static int TimeoutMs(Clock::time_point now, Clock::time_point wake_at) {
    if (wake_at == Clock::time_point::max()) return -1;
    if (wake_at <= now) return 0;
    const auto wait = std::chrono::ceil<std::chrono::milliseconds>(wake_at - now).count();
    return static_cast<int>(std::min<int64_t>(wait, 60'000));
  }

  void Accept(Clock::time_point now) {
    std::erase_if(connections_, [](const Connection& c) { return c.stage == Stage::kClosed; });
    // At most one round of max_connections per wake-up, so a flood of connects cannot keep the
    // thread from the clients it has.
    for (int round = 0; round < params_.max_connections; ++round) {
      Descriptor socket(accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (socket.get() < 0) {
        const int error = errno;
        if (error == EAGAIN || error == EWOULDBLOCK) return;
        if (error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM) {
          if (EvictOne()) continue;
          accept_paused_until_ = now + kAcceptPause;
          return;
        }
        continue;  // the connection failed before it was accepted (ECONNABORTED and the like)
      }
      if (static_cast<int>(connections_.size()) >= params_.max_connections && !EvictOne()) {
        continue;  // every connection is being answered: this one is closed unanswered
      }
      Connection& connection = connections_.emplace_back();
      connection.socket = std::move(socket);
      connection.opened = now;
      connection.deadline = now + params_.request_timeout;
    }
  }

  // Closes the oldest connection that is only draining, else the one waiting longest for its
  // request head; never one being answered. False when there is none.
  bool EvictOne() {
    auto oldest = connections_.end();
    for (Stage stage : {Stage::kDraining, Stage::kReadingHead}) {
      for (auto it = connections_.begin(); it != connections_.end(); ++it) {
        if (it->stage == stage && (oldest == connections_.end() || it->opened < oldest->opened)) {
          oldest = it;
        }
      }
      if (oldest != connections_.end()) {
        connections_.erase(oldest);
        return true;
      }
    }
    return false;
  }

  void Advance(Connection& connection, Clock::time_point now) {
    switch (connection.stage) {
      case Stage::kReadingHead:
        return ReadHead(connection, now);
      case Stage::kWriting:
        return Write(connection);
      case Stage::kDraining:
        return Drain(connection);
      case Stage::kClosed:
        return;
    }
  }

  void ReadHead(Connection& connection, Clock::time_point now) {
    char buffer[4096];
    for (;;) {
      const size_t room = params_.max_request_bytes - connection.received.size();
      const ssize_t n = recv(connection.socket.get(), buffer, std::min(sizeof buffer, room), 0);
      if (n > 0) {
        const size_t from = connection.received.size() >= 3 ? connection.received.size() - 3 : 0;
        connection.received.append(buffer, static_cast<size_t>(n));
        if (HeadComplete(connection.received, from)) return Answer(connection, now);
        if (connection.received.size() >= params_.max_request_bytes) {
          return Respond(
              connection, now, "431 Request Header Fields Too Large",
              "request head longer than " + std::to_string(params_.max_request_bytes) + " bytes\n");
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      return Close(connection);  // gone, or failed, before a whole request
    }
  }

  void Answer(Connection& connection, Clock::time_point now) {
    std::string_view line = connection.received;
    line = line.substr(0, line.find('\n'));
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const size_t method_end = line.find(' ');
    const size_t target_end = line.find(' ', method_end + 1);
    if (method_end == std::string_view::npos || target_end == std::string_view::npos ||
        !line.substr(target_end + 1).starts_with("HTTP/1.")) {
      return Respond(connection, now, "400 Bad Request", "not an HTTP/1.x request line\n");
    }
    const std::string_view method = line.substr(0, method_end);
    const std::string_view target = line.substr(method_end + 1, target_end - method_end - 1);
    if (method != "GET" && method != "HEAD") {
      return Respond(connection, now, "405 Method Not Allowed", "only GET and HEAD\n",
                     "Allow: GET, HEAD\r\n");
    }
    if (target.substr(0, target.find('?')) != params_.path) {
      return Respond(connection, now, "404 Not Found", "metrics are at " + params_.path + "\n");
    }
    std::string page;
    try {
      page = params_.page();
    } catch (const std::exception& error) {
      return Respond(connection, now, "500 Internal Server Error",
                     std::string("cannot build the page: ") + error.what() + "\n");
    }
    Respond(connection, now, "200 OK", page, "", params_.content_type, method == "HEAD");
  }

  void Respond(Connection& connection, Clock::time_point now, std::string_view status,
               const std::string& body, std::string_view extra_headers = "",
               std::string_view content_type = "text/plain; charset=utf-8",
               bool head_only = false) {
    std::string& response = connection.response;
    response.reserve(160 + (head_only ? 0 : body.size()));
    response.append("HTTP/1.1 ").append(status).append("\r\nContent-Type: ");
    response.append(content_type).append("\r\nContent-Length: ");
    response.append(std::to_string(body.size())).append("\r\n").append(extra_headers);
    response.append("Connection: close\r\n\r\n");
    if (!head_only) response.append(body);
    connection.received = std::string();
    connection.stage = Stage::kWriting;
    connection.deadline = now + params_.response_timeout;
    Write(connection);
  }

  void Write(Connection& connection) {
    while (connection.sent < connection.response.size()) {
      const ssize_t n = send(connection.socket.get(), connection.response.data() + connection.sent,
                             connection.response.size() - connection.sent, MSG_NOSIGNAL);
      if (n > 0) {
        connection.sent += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      return Close(connection);
    }
    // Everything is with the kernel; the FIN follows it. Keep reading until the client closes
    // (or the response deadline), so that its leftover input cannot reset the connection.
    connection.response = std::string();
    shutdown(connection.socket.get(), SHUT_WR);
    connection.stage = Stage::kDraining;
  }

  void Drain(Connection& connection) {
    char buffer[4096];
    for (;;) {
      const ssize_t n = recv(connection.socket.get(), buffer, sizeof buffer, 0);
      if (n > 0) continue;
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      return Close(connection);
    }
  }

  static void Close(Connection& connection) {
    connection.socket.Reset();
    connection.stage = Stage::kClosed;
  }

  const ScrapeServerParams params_;
  const Descriptor listener_;
  const Descriptor wake_;
  std::vector<Connection> connections_;  // only the server thread touches these two
  Clock::time_point accept_paused_until_{};
  std::thread thread_;  // last: it starts once everything above exists
};

Result<std::unique_ptr<ScrapeServer>> ScrapeServer::Start(ScrapeServerParams params) {
  const std::string cannot = "cannot serve on '" + params.address.ToString() + "'";
  if (!params.page || params.max_connections < 1 || params.max_request_bytes < 16) {
    return InvalidArgument(cannot + ": the server needs a page, a connection and 16 bytes");
  }
  Result<SocketAddress> address = Resolve(params.address);
  if (!address.ok()) return address.status().WithContext(cannot);
  Descriptor listener(socket(address->family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (listener.get() < 0) return IoError(cannot + ": socket: " + SystemMessage(errno));
  const int one = 1;
  // A restarted trainer can take its port back while the old connections sit in TIME_WAIT.
  setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(listener.get(), address->get(), address->size) != 0) {
    const int error = errno;
    return InvalidArgument(cannot + ": " + BindProblem(error) + " (" + SystemMessage(error) + ")");
  }
  if (listen(listener.get(), SOMAXCONN) != 0) {
    return IoError(cannot + ": listen: " + SystemMessage(errno));
  }
  Descriptor wake(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (wake.get() < 0) return IoError(cannot + ": eventfd: " + SystemMessage(errno));

  std::unique_ptr<ScrapeServer> server(new ScrapeServer());
  Result<std::string> bound = BoundAddress(listener.get(), &server->bound_port_);
  if (!bound.ok()) return bound.status().WithContext(cannot);
  server->bound_address_ = *std::move(bound);
  try {
    server->loop_ = std::make_unique<Loop>(std::move(params), std::move(listener), std::move(wake));
  } catch (const std::exception& error) {  // std::thread could not start one
    return Internal(cannot + ": cannot start the server thread: " + error.what());
  }
  return server;
}

ScrapeServer::~ScrapeServer() = default;

}  // namespace keel
