// Tests of the scrape server's HTTP: what each request gets back, request heads that arrive in
// pieces or never end, the connection limit (idle clients give way to a new one), timeouts, and
// bind errors that name the address. (Scrapes of a real exporter under abuse: metrics_test.cc.)
#include "monitor/scrape_server.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/monitor/http_test_util.h"

namespace keel {
namespace {

using namespace std::chrono_literals;
using testing::HttpExchange;
using testing::HttpGet;
using testing::HttpReply;
using testing::TestConnection;

std::unique_ptr<ScrapeServer> StartServer(ScrapeServerParams params = {}) {
  params.address = ListenAddress{"127.0.0.1", 0, false};
  if (!params.page) params.page = [] { return std::string("keel_up 1\n"); };
  Result<std::unique_ptr<ScrapeServer>> server = ScrapeServer::Start(std::move(params));
  EXPECT_TRUE(server.ok()) << server.status().ToString();
  return server.ok() ? std::move(server).value() : nullptr;
}

TEST(ScrapeServerTest, AnswersGetAndHeadOfItsPathOnly) {
  std::atomic<int> built{0};
  ScrapeServerParams params;
  params.page = [&] { return "keel_up " + std::to_string(++built) + "\n"; };
  auto server = StartServer(std::move(params));
  ASSERT_NE(server, nullptr);
  const int port = server->bound_port();
  EXPECT_EQ(server->bound_address(), "127.0.0.1:" + std::to_string(port));

  HttpReply reply = HttpGet("127.0.0.1", port, "/metrics?name[]=keel_up");
  EXPECT_EQ(reply.status, 200);
  EXPECT_EQ(reply.body, "keel_up 1\n");
  EXPECT_NE(reply.head.find("Content-Length: 10\r\n"), std::string::npos) << reply.head;
  EXPECT_NE(reply.head.find("Connection: close"), std::string::npos) << reply.head;

  reply = HttpExchange("127.0.0.1", port, "HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(reply.status, 200);
  EXPECT_EQ(reply.body, "");
  EXPECT_NE(reply.head.find("Content-Length: 10\r\n"), std::string::npos) << reply.head;

  EXPECT_EQ(HttpGet("127.0.0.1", port, "/").status, 404);
  EXPECT_EQ(HttpGet("127.0.0.1", port, "/metricsx").status, 404);
  reply = HttpExchange("127.0.0.1", port, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(reply.status, 405);
  EXPECT_NE(reply.head.find("Allow: GET, HEAD"), std::string::npos) << reply.head;
  EXPECT_EQ(HttpExchange("127.0.0.1", port, "hello\r\n\r\n").status, 400);
  EXPECT_EQ(HttpExchange("127.0.0.1", port, "GET /metrics SPDY/3\r\n\r\n").status, 400);
  // Line feeds alone end a head too (lenient clients, netcat by hand).
  EXPECT_EQ(HttpExchange("127.0.0.1", port, "GET /metrics HTTP/1.1\n\n").status, 200);
  EXPECT_EQ(built.load(), 3);  // only the GETs and the HEAD of /metrics built it
}

TEST(ScrapeServerTest, ReadsAHeadSentInPiecesAndRefusesAnOverlongOne) {
  ScrapeServerParams params;
  params.max_request_bytes = 64;
  auto server = StartServer(std::move(params));
  ASSERT_NE(server, nullptr);
  TestConnection pieces("127.0.0.1", server->bound_port());
  for (const char* piece : {"GET /met", "rics HTTP/1.1\r", "\nHost: x\r\n\r", "\n"}) {
    ASSERT_TRUE(pieces.Send(piece));
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_NE(pieces.ReadAll(5s).find("keel_up 1"), std::string::npos);

  const HttpReply reply = HttpExchange("127.0.0.1", server->bound_port(),
                                       "GET /metrics HTTP/1.1\r\nX: " + std::string(100, 'a'));
  EXPECT_EQ(reply.status, 431);
}

TEST(ScrapeServerTest, APageThatThrowsIsA500AndServingGoesOn) {
  std::atomic<bool> fail{true};
  ScrapeServerParams params;
  params.page = [&]() -> std::string {
    if (fail) throw std::runtime_error("registry gone");
    return "keel_up 1\n";
  };
  auto server = StartServer(std::move(params));
  ASSERT_NE(server, nullptr);
  const HttpReply reply = HttpGet("127.0.0.1", server->bound_port());
  EXPECT_EQ(reply.status, 500);
  EXPECT_NE(reply.body.find("registry gone"), std::string::npos) << reply.body;
  fail = false;
  EXPECT_EQ(HttpGet("127.0.0.1", server->bound_port()).status, 200);
}

// Beyond max_connections the client waiting longest for its head gives way, so any number of
// idle clients cannot keep a scrape out.
TEST(ScrapeServerTest, IdleClientsGiveWayToNewOnesBeyondTheLimit) {
  ScrapeServerParams params;
  params.max_connections = 4;
  auto server = StartServer(std::move(params));
  ASSERT_NE(server, nullptr);
  std::vector<TestConnection> idle;
  for (int i = 0; i < 4; ++i) {
    idle.emplace_back("127.0.0.1", server->bound_port());
    ASSERT_TRUE(idle.back().ok());
    std::this_thread::sleep_for(5ms);  // accepted one after the other: idle[0] is the oldest
  }
  const HttpReply reply = HttpGet("127.0.0.1", server->bound_port(), "/metrics", 5s);
  EXPECT_EQ(reply.status, 200);
  // The oldest idle client was closed (EOF at once), the newest is still open.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(idle[0].ReadAll(3s), "");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  ASSERT_TRUE(idle[3].Send("GET /metrics HTTP/1.1\r\n\r\n"));
  EXPECT_NE(idle[3].ReadAll(5s).find("keel_up 1"), std::string::npos);
}

TEST(ScrapeServerTest, ClosesAClientThatDoesNotSendItsHeadInTime) {
  ScrapeServerParams params;
  params.request_timeout = 200ms;
  auto server = StartServer(std::move(params));
  ASSERT_NE(server, nullptr);
  TestConnection slow("127.0.0.1", server->bound_port());
  ASSERT_TRUE(slow.Send("GET /metrics HTTP/1.1\r\n"));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(slow.ReadAll(5s), "");  // closed without an answer
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, 150ms);
  EXPECT_LT(waited, 4s);
}

TEST(ScrapeServerTest, APortInUseIsNamedWithTheReason) {
  auto first = StartServer();
  ASSERT_NE(first, nullptr);
  ScrapeServerParams params;
  params.page = [] { return std::string(); };
  params.address = ListenAddress{"127.0.0.1", first->bound_port(), false};
  Result<std::unique_ptr<ScrapeServer>> taken = ScrapeServer::Start(params);
  ASSERT_FALSE(taken.ok());
  EXPECT_NE(taken.status().message().find("'" + first->bound_address() + "': the port is in use"),
            std::string::npos)
      << taken.status().message();
}

TEST(ScrapeServerTest, AHostNameBindsItsIpv4Address) {
  ScrapeServerParams params;
  params.page = [] { return std::string("keel_up 1\n"); };
  params.address = ListenAddress{"localhost", 0, false};
  Result<std::unique_ptr<ScrapeServer>> server = ScrapeServer::Start(std::move(params));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  EXPECT_EQ((*server)->bound_address(), "127.0.0.1:" + std::to_string((*server)->bound_port()));
  EXPECT_EQ(HttpGet("127.0.0.1", (*server)->bound_port()).status, 200);
}

}  // namespace
}  // namespace keel
