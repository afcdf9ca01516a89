// The /metrics endpoint: a civetweb HTTP server that answers GET /metrics
// with a registry's text exposition (Content-Type
// `text/plain; version=0.0.4; charset=utf-8`) and 404 for any other path.
//
//   CANZONA_ASSIGN_OR_RETURN(
//       std::unique_ptr<MetricsHttpServer> server,
//       MetricsHttpServer::Start("127.0.0.1:0", &registry));
//   int port = server->port();  // the bound port (0 asks for a free one)
//
// Thread-safety: thread-safe; requests are served on civetweb's threads.
// The registry must outlive the server; the destructor stops serving, at
// once (it wakes civetweb's listener, which would otherwise notice the
// stop only at the end of its 2 s poll).
#ifndef CANZONA_SERVER_METRICS_HTTP_SERVER_H_
#define CANZONA_SERVER_METRICS_HTTP_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/metrics/registry.h"

struct mg_connection;
struct mg_context;

namespace canzona {

inline constexpr char kPrometheusContentType[] =
    "text/plain; version=0.0.4; charset=utf-8";

class MetricsHttpServer {
 public:
  // `address` is host:port (IPv4, e.g. 127.0.0.1:9464 or 0.0.0.0:9464) or
  // [v6]:port. INVALID_ARGUMENT for a malformed address, UNAVAILABLE when
  // it cannot bind.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, MetricsRegistry* registry);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpServer(MetricsRegistry* registry) : registry_(registry) {}
  static int Handle(::mg_connection* conn, void* self);

  MetricsRegistry* registry_;
  mg_context* context_ = nullptr;
  int port_ = 0;
  // Where a connection reaches the listening socket: the bound host, or
  // loopback for a wildcard address.
  std::string wake_host_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_METRICS_HTTP_SERVER_H_
