// Loopback clients for the exporter's tests: a raw TCP connection (to hold idle, to drip a
// request, or to speak HTTP by hand) and a timed GET, over IPv4 or IPv6.
#pragma once

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <string_view>
#include <utility>

namespace keel::testing {

// One client connection; closed on destruction.
class TestConnection {
 public:
  // Connects to the numeric `host` ("127.0.0.1", "::1") and `port`; ok() is false on failure.
  TestConnection(const std::string& host, int port) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return;
    fd_ = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ >= 0 && connect(fd_, found->ai_addr, found->ai_addrlen) != 0) Close();
    freeaddrinfo(found);
  }
  TestConnection(TestConnection&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  TestConnection& operator=(TestConnection&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  ~TestConnection() { Close(); }

  bool ok() const { return fd_ >= 0; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  // False once the server has closed the connection (the second send after its FIN fails).
  bool Send(std::string_view bytes) {
    return ok() && send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
                       static_cast<ssize_t>(bytes.size());
  }
  // Everything received until the server closes, or until `timeout` has passed.
  std::string ReadAll(std::chrono::milliseconds timeout) {
    std::string received;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (ok()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      pollfd polled{fd_, POLLIN, 0};
      if (left.count() <= 0 || poll(&polled, 1, static_cast<int>(left.count())) <= 0) break;
      char buffer[65536];
      const ssize_t n = recv(fd_, buffer, sizeof buffer, 0);
      if (n <= 0) break;
      received.append(buffer, static_cast<size_t>(n));
    }
    return received;
  }

 private:
  int fd_ = -1;
};

struct HttpReply {
  int status = 0;  // 0 when no status line came back
  std::string head;
  std::string body;
  double seconds = 0;  // from connect to the server's close
};

// Sends `request` (a whole HTTP request) and reads the reply until the server closes.
inline HttpReply HttpExchange(const std::string& host, int port, std::string_view request,
                              std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto start = std::chrono::steady_clock::now();
  TestConnection connection(host, port);
  HttpReply reply;
  if (connection.Send(request)) {
    const std::string received = connection.ReadAll(timeout);
    const size_t end = received.find("\r\n\r\n");
    reply.head = received.substr(0, end);
    if (end != std::string::npos) reply.body = received.substr(end + 4);
    if (reply.head.starts_with("HTTP/1.") && reply.head.size() >= 12) {
      reply.status = std::stoi(reply.head.substr(9, 3));
    }
  }
  reply.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return reply;
}

inline HttpReply HttpGet(const std::string& host, int port, const std::string& target = "/metrics",
                         std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  return HttpExchange(host, port, "GET " + target + " HTTP/1.1\r\nHost: keel-test\r\n\r\n",
                      timeout);
}

// Whether this machine can listen and connect on [::1] (containers often lack IPv6 loopback).
inline bool HaveIpv6Loopback() {
  const int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in6 address{};
  address.sin6_family = AF_INET6;
  address.sin6_addr = in6addr_loopback;
  const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
  ::close(fd);
  return bound;
}

}  // namespace keel::testing
