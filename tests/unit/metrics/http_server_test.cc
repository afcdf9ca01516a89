#include "server/metrics/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// A plain HTTP/1.0 request on loopback; the whole response (headers and
// body), empty when the connection fails.
std::string HttpRequest(int port, const std::string& method,
                        const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request =
        method + " " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (::send(fd, request.data(), request.size(), 0) ==
        static_cast<ssize_t>(request.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) response.append(buf, n);
    }
  }
  ::close(fd);
  return response;
}

TEST(MetricsHttpServerTest, ServesMetricsWithTheExactContentType) {
  MetricsRegistry registry;
  registry.AddCounter("demo_total", "Demo.", {"k"})
      ->WithLabels({"v"})
      ->Increment(3);
  ASSERT_OK_AND_ASSIGN(auto server,
                       MetricsHttpServer::Start("127.0.0.1:0", &registry));
  ASSERT_GT(server->port(), 0);
  const std::string response = HttpRequest(server->port(), "GET", "/metrics");
  EXPECT_THAT(response, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(response,
              HasSubstr("\r\nContent-Type: text/plain; version=0.0.4; "
                        "charset=utf-8\r\n"));
  const size_t body = response.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos);
  EXPECT_EQ(response.substr(body + 4), registry.Expose());
  EXPECT_THAT(response, HasSubstr("demo_total{k=\"v\"} 3\n"));
}

TEST(MetricsHttpServerTest, NotFoundElsewhereAndGetOnly) {
  MetricsRegistry registry;
  ASSERT_OK_AND_ASSIGN(auto server,
                       MetricsHttpServer::Start("127.0.0.1:0", &registry));
  EXPECT_THAT(HttpRequest(server->port(), "GET", "/"),
              StartsWith("HTTP/1.1 404"));
  EXPECT_THAT(HttpRequest(server->port(), "GET", "/metricsx"),
              StartsWith("HTTP/1.1 404"));
  EXPECT_THAT(HttpRequest(server->port(), "GET", "/metrics/x"),
              StartsWith("HTTP/1.1 404"));
  EXPECT_THAT(HttpRequest(server->port(), "POST", "/metrics"),
              StartsWith("HTTP/1.1 405"));
}

TEST(MetricsHttpServerTest, BindFailureIsAStatus) {
  MetricsRegistry registry;
  ASSERT_OK_AND_ASSIGN(auto first,
                       MetricsHttpServer::Start("127.0.0.1:0", &registry));
  auto second = MetricsHttpServer::Start(
      "127.0.0.1:" + std::to_string(first->port()), &registry);
  EXPECT_THAT(second.status(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(MetricsHttpServer::Start("nonsense", &registry).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// A daemon's shutdown (and a coordinator's, which waits for its peers'
// calls to end) waited for civetweb's listener poll, 2 s per stop. Not a
// speed target: a bound between the ~20 ms of a woken poll and the 2 s of
// the unwoken one, for loopback and wildcard addresses alike.
TEST(MetricsHttpServerTest, StopsWithoutWaitingForTheListenerPoll) {
  MetricsRegistry registry;
  for (const char* address : {"127.0.0.1:0", "0.0.0.0:0"}) {
    ASSERT_OK_AND_ASSIGN(auto server,
                         MetricsHttpServer::Start(address, &registry));
    const int port = server->port();
    // A scrape: the listener is back in its poll, with a fresh 2 s.
    ASSERT_THAT(HttpRequest(port, "GET", "/metrics"),
                StartsWith("HTTP/1.1 200"));
    const absl::Time start = absl::Now();
    server.reset();
    EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << address;
    EXPECT_EQ(HttpRequest(port, "GET", "/metrics"), "") << address;
  }
}

}  // namespace
}  // namespace canzona
