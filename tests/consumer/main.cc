// Links Canzona::client from an installed package and uses it: allocates a
// shared tensor and tries a daemon that is not there.
#include <cstdio>
#include <string>

#include "client/lib/client.h"

int main(int argc, char** argv) {
  const std::string target =
      argc > 1 ? argv[1] : "unix:/nonexistent/canzona.sock";
  canzona::Client::Options options;
  options.connect_timeout = absl::Milliseconds(200);
  auto client = canzona::Client::Connect(target, options);
  if (client.ok()) {
    std::printf("connected to %s\n", target.c_str());
    return 0;
  }
  // The expected outcome without a daemon: a clear UNAVAILABLE.
  std::printf("%s\n", std::string(client.status().message()).c_str());
  return absl::IsUnavailable(client.status()) ? 0 : 1;
}
