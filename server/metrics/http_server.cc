#include "server/metrics/http_server.h"

#include <civetweb.h>
#include <dlfcn.h>
#include <netdb.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

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

// The host a local connection to a server bound on `host` uses.
std::string WakeHost(std::string host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

// Opens a TCP connection to the first of `addresses` that accepts and
// closes it (best effort).
void Knock(const struct addrinfo* addresses) {
  for (const struct addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int connected = ::connect(fd, a->ai_addr, a->ai_addrlen);
    ::close(fd);
    if (connected == 0) return;
  }
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
  server->wake_host_ = WakeHost(address.substr(0, colon));
  mg_set_request_handler(server->context_, "/", &MetricsHttpServer::Handle,
                         server.get());
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (context_ == nullptr) return;
  // mg_stop sets a flag and waits for civetweb's master thread, which
  // reads it only when its poll of the listening socket returns: at a
  // connection, else after 2 s (SOCKET_TIMEOUT_QUANTUM). A daemon's
  // shutdown, and a coordinator's waiting for that daemon's calls to end,
  // took those 2 s each time. A connection every 20 ms ends the poll.
  struct addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  struct addrinfo* listener = nullptr;
  if (::getaddrinfo(wake_host_.c_str(), std::to_string(port_).c_str(), &hints,
                    &listener) != 0) {
    listener = nullptr;  // mg_stop then takes its 2 s
  }
  absl::Notification stopped;
  std::thread knocker([listener, &stopped] {
    while (!stopped.WaitForNotificationWithTimeout(absl::Milliseconds(20))) {
      Knock(listener);
    }
  });
  mg_stop(context_);
  stopped.Notify();
  knocker.join();
  if (listener != nullptr) ::freeaddrinfo(listener);
}

}  // namespace canzona
