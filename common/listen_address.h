// The address a Keel server listens on (the Prometheus exporter), parsed in one place so that
// every flag and config key naming one (`--serve-metrics`, `--metrics`, monitor.metrics_address)
// accepts and refuses the same text with the same words.
#pragma once

#include <string>
#include <string_view>

#include "keel/status.hpp"

namespace keel {

struct ListenAddress {
  // An IPv4 literal ("127.0.0.1"), an IPv6 literal without brackets ("::1"), or a host name
  // (letters, digits, hyphens and underscores in dot-separated labels) resolved when binding.
  std::string host;
  int port = 0;  // 0..65535; 0 asks for a free port
  bool ipv6 = false;

  // "127.0.0.1:9400", "[::1]:9400", "node7:9400": the form ParseListenAddress reads.
  std::string ToString() const;
};

// Reads `[v6addr]:port`, `host:port` (host an IPv4 literal or a host name) or `port` alone,
// which listens on 127.0.0.1. Anything else (an empty host, an IPv6 address without brackets,
// "256.1.1.1", a port outside 0..65535, "" itself) is InvalidArgument naming `text`.
Result<ListenAddress> ParseListenAddress(std::string_view text);

}  // namespace keel
