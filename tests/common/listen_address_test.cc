// Tests of ParseListenAddress, the one reader of `--serve-metrics`, `keel demo --metrics` and
// monitor.metrics_address: every accepted form, and refusals that name the value.
#include "common/listen_address.h"

#include <gtest/gtest.h>

#include <string>

namespace keel {
namespace {

TEST(ListenAddressTest, ReadsPortHostPortAndBracketedIpv6) {
  struct Case {
    const char* text;
    const char* host;
    int port;
    bool ipv6;
    const char* written;
  };
  for (const Case& c : {
           Case{"9400", "127.0.0.1", 9400, false, "127.0.0.1:9400"},
           Case{"0", "127.0.0.1", 0, false, "127.0.0.1:0"},
           Case{"0.0.0.0:80", "0.0.0.0", 80, false, "0.0.0.0:80"},
           Case{"10.1.2.3:65535", "10.1.2.3", 65535, false, "10.1.2.3:65535"},
           Case{"localhost:9400", "localhost", 9400, false, "localhost:9400"},
           Case{"node-7.cluster_a:1", "node-7.cluster_a", 1, false, "node-7.cluster_a:1"},
           Case{"[::1]:0", "::1", 0, true, "[::1]:0"},
           Case{"[::]:9400", "::", 9400, true, "[::]:9400"},
           Case{"[fe80::1:2]:8080", "fe80::1:2", 8080, true, "[fe80::1:2]:8080"},
           Case{"[::ffff:127.0.0.1]:9", "::ffff:127.0.0.1", 9, true, "[::ffff:127.0.0.1]:9"},
       }) {
    Result<ListenAddress> address = ParseListenAddress(c.text);
    ASSERT_TRUE(address.ok()) << c.text << ": " << address.status().ToString();
    EXPECT_EQ(address->host, c.host) << c.text;
    EXPECT_EQ(address->port, c.port) << c.text;
    EXPECT_EQ(address->ipv6, c.ipv6) << c.text;
    EXPECT_EQ(address->ToString(), c.written) << c.text;
  }
}

TEST(ListenAddressTest, RefusesAnythingElseNamingTheValue) {
  struct Case {
    const char* text;
    const char* why;
  };
  for (const Case& c : {
           Case{"abc", "port 'abc' is not a number in 0..65535"},
           Case{"9400x", "is not a number"},
           Case{"+9400", "is not a number"},
           Case{"-1", "is not a number"},
           Case{"65536", "is not a number"},
           Case{"host:", "port '' is not a number"},
           Case{":9400", "has an empty host"},
           Case{"1.2.3.4:70000", "port '70000'"},
           Case{"127.0.0.1:9400s", "port '9400s'"},
           Case{"9400,9401", "is not a number"},
           Case{"256.1.1.1:0", "'256.1.1.1' is not an IPv4 address"},
           Case{"1.2.3:80", "'1.2.3' is not an IPv4 address"},
           Case{"::1:9400", "write an IPv6 host in brackets"},
           Case{"::1", "write an IPv6 host in brackets"},
           Case{"[::1]", "needs its port after the brackets"},
           Case{"[::1]9400", "needs its port after the brackets"},
           Case{"[::1:9400", "needs its port after the brackets"},
           Case{"[::1]:", "port '' is not a number"},
           Case{"[::1]:http", "port 'http'"},
           Case{"[1.2.3.4]:80", "'1.2.3.4' is not an IPv6 address"},
           Case{"[]:80", "'' is not an IPv6 address"},
           Case{"[localhost]:80", "'localhost' is not an IPv6 address"},
           Case{"a,b:80", "'a,b' is neither an IP address nor a host name"},
           Case{"ho st:80", "is neither"},
           Case{"-host:80", "is neither"},
           Case{"host..x:80", "is neither"},
           Case{"host.:80", "is neither"},
       }) {
    Result<ListenAddress> address = ParseListenAddress(c.text);
    ASSERT_FALSE(address.ok()) << c.text << " parsed as " << address->ToString();
    EXPECT_EQ(address.status().code(), StatusCode::kInvalidArgument);
    const std::string& message = address.status().message();
    EXPECT_NE(message.find("address '" + std::string(c.text) + "'"), std::string::npos) << message;
    EXPECT_NE(message.find(c.why), std::string::npos) << c.text << ": " << message;
  }
  EXPECT_EQ(ParseListenAddress("").status().code(), StatusCode::kInvalidArgument);
  const std::string long_label(64, 'a');
  EXPECT_FALSE(ParseListenAddress(long_label + ":80").ok());
  EXPECT_TRUE(ParseListenAddress(long_label.substr(1) + ":80").ok());
}

}  // namespace
}  // namespace keel
