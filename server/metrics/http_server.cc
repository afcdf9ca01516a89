#include "server/metrics/http_server.h"

#include <civetweb.h>
#include <dlfcn.h>
#include <pthread.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

// Debian's civetweb is built with USE_STACK_SIZE=102400: every server
// thread asks pthread_attr_setstacksize for 100 KiB. glibc puts the static
// TLS of all loaded libraries on each thread's stack, and canzonad's
// (cuBLASLt, OpenBLAS, cuSOLVER, ...) is over 200 KiB, so pthread_create
// fails with EINVAL ("Cannot create first worker thread"). This
// interposer raises requested stack sizes below 1 MiB to 1 MiB for every
// caller outside libc (virtual memory, committed lazily); libc's internal
// calls are not affected.
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr,
                                         size_t stacksize) {
  using Fn = int (*)(pthread_attr_t*, size_t);
  static const Fn real =
      reinterpret_cast<Fn>(::dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  constexpr size_t kMinStack = size_t{1} << 20;
  if (real == nullptr) return EINVAL;
  return real(attr, stacksize < kMinStack ? kMinStack : stacksize);
}

namespace canzona {
namespace {

void Reply(::mg_connection* conn, int code, const char* reason,
           const char* content_type, const std::string& body,
           bool head = false) {
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Connection: close\r\n\r\n",
            code, reason, content_type, body.size());
  if (!head && !body.empty()) mg_write(conn, body.data(), body.size());
}

}  // namespace

int MetricsHttpServer::Handle(::mg_connection* conn, void* self) {
  auto* server = static_cast<MetricsHttpServer*>(self);
  const struct mg_request_info* info = mg_get_request_info(conn);
  const char* uri = info->local_uri != nullptr ? info->local_uri : "";
  const char* method =
      info->request_method != nullptr ? info->request_method : "";
  if (std::strcmp(uri, "/metrics") != 0) {
    Reply(conn, 404, "Not Found", "text/plain; charset=utf-8",
          "404 not found: try /metrics\n");
    return 404;
  }
  const bool head = std::strcmp(method, "HEAD") == 0;
  if (!head && std::strcmp(method, "GET") != 0) {
    Reply(conn, 405, "Method Not Allowed", "text/plain; charset=utf-8",
          "405 method not allowed: GET /metrics\n");
    return 405;
  }
  Reply(conn, 200, "OK", kPrometheusContentType, server->registry_->Expose(),
        head);
  return 200;
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, MetricsRegistry* registry) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", address, "\" is not host:port"));
  }
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer(registry));
  const char* options[] = {
      "listening_ports",    address.c_str(), "num_threads", "2",
      "request_timeout_ms", "10000",         nullptr};
  struct mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  // civetweb prints its own errors to stderr by default; keep them out.
  callbacks.log_message = [](const ::mg_connection*, const char*) { return 1; };
  struct mg_init_data init;
  std::memset(&init, 0, sizeof(init));
  init.callbacks = &callbacks;
  init.user_data = server.get();
  init.configuration_options = options;
  char error_text[256] = {0};
  unsigned error_code = 0;
  struct mg_error_data error;
  std::memset(&error, 0, sizeof(error));
  error.code = &error_code;
  error.text = error_text;
  error.text_buffer_size = sizeof(error_text);
  server->context_ = mg_start2(&init, &error);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ",
                     error_text[0] != '\0' ? error_text : "mg_start failed"));
  }
  struct mg_server_port ports[4];
  std::memset(ports, 0, sizeof(ports));
  const int n = mg_get_server_ports(server->context_, 4, ports);
  if (n < 1 || ports[0].port <= 0) {
    return absl::InternalError(
        absl::StrCat("metrics server on ", address, ": no bound port"));
  }
  server->port_ = ports[0].port;
  mg_set_request_handler(server->context_, "/", &MetricsHttpServer::Handle,
                         server.get());
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (context_ != nullptr) mg_stop(context_);
}

}  // namespace canzona
