// ParseListenAddress: literals are checked with inet_pton, so what parses here also binds as
// written; host names are only checked for their form, since resolving them is the server's job.
#include "common/listen_address.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>
#include <charconv>

namespace keel {
namespace {

// A host name: labels of 1..63 letters, digits, hyphens and underscores (RFC 1123 has no
// underscore, but container and cluster names often do), no hyphen at either end; 253
// characters at most.
bool IsHostName(std::string_view host) {
  if (host.empty() || host.size() > 253) return false;
  size_t start = 0;
  while (start <= host.size()) {
    const size_t dot = std::min(host.find('.', start), host.size());
    const std::string_view label = host.substr(start, dot - start);
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
      return false;
    }
    for (char c : label) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') return false;
    }
    start = dot + 1;
  }
  return true;
}

bool IsNumeric(std::string_view host) {
  return std::all_of(host.begin(), host.end(),
                     [](char c) { return (c >= '0' && c <= '9') || c == '.'; });
}

}  // namespace

std::string ListenAddress::ToString() const {
  return (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Result<ListenAddress> ParseListenAddress(std::string_view text) {
  const std::string quoted = "address '" + std::string(text) + "'";
  const std::string forms = "; use [v6addr]:port, host:port or port";
  if (text.empty()) return InvalidArgument("the listen address is empty" + forms);

  ListenAddress address;
  std::string_view port_text = text;
  if (text.front() == '[') {
    const size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return InvalidArgument(quoted + ": an IPv6 address needs its port after the brackets, " +
                             "e.g. [::1]:9400");
    }
    address.host = std::string(text.substr(1, close - 1));
    address.ipv6 = true;
    in6_addr parsed{};
    if (inet_pton(AF_INET6, address.host.c_str(), &parsed) != 1) {
      return InvalidArgument(quoted + ": '" + address.host + "' is not an IPv6 address");
    }
    port_text = text.substr(close + 2);
  } else if (const size_t colon = text.rfind(':'); colon != std::string_view::npos) {
    address.host = std::string(text.substr(0, colon));
    port_text = text.substr(colon + 1);
    if (address.host.empty()) return InvalidArgument(quoted + " has an empty host" + forms);
    if (address.host.find(':') != std::string::npos) {
      return InvalidArgument(quoted + ": write an IPv6 host in brackets, e.g. [::1]:9400");
    }
    in_addr parsed{};
    if (IsNumeric(address.host) && inet_pton(AF_INET, address.host.c_str(), &parsed) != 1) {
      return InvalidArgument(quoted + ": '" + address.host + "' is not an IPv4 address");
    }
    if (!IsNumeric(address.host) && !IsHostName(address.host)) {
      return InvalidArgument(quoted + ": '" + address.host +
                             "' is neither an IP address nor a host name");
    }
  } else {
    address.host = "127.0.0.1";
  }
  const char* end = port_text.data() + port_text.size();
  const auto [last, error] = std::from_chars(port_text.data(), end, address.port);
  if (port_text.empty() || error != std::errc() || last != end || address.port < 0 ||
      address.port > 65535) {
    return InvalidArgument(quoted + ": port '" + std::string(port_text) +
                           "' is not a number in 0..65535" + forms);
  }
  return address;
}

}  // namespace keel
