#include "server/rpc/transport_security.h"

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpcpp/client_context.h>

#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace canzona {
namespace {

constexpr absl::string_view kBearerScheme = "bearer ";

absl::string_view SliceView(const grpc_slice& slice) {
  return absl::string_view(
      reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(slice)),
      GRPC_SLICE_LENGTH(slice));
}

// grpc_auth_metadata_processor.process: runs in gRPC's server auth filter
// for every call on the port, before the call reaches a handler. `state` is
// the token (a std::string). Answers inline, which gRPC allows.
void ProcessBearerToken(void* state, grpc_auth_context* /*context*/,
                        const grpc_metadata* metadata, size_t count,
                        grpc_process_auth_metadata_done_cb done,
                        void* user_data) {
  const std::string& token = *static_cast<const std::string*>(state);
  std::vector<absl::string_view> authorization;
  absl::string_view path;
  for (size_t i = 0; i < count; ++i) {
    const absl::string_view key = SliceView(metadata[i].key);
    if (key == kAuthorizationKey) {
      authorization.push_back(SliceView(metadata[i].value));
    } else if (key == ":path") {
      path = SliceView(metadata[i].value);
    }
  }
  if (IsExemptFromToken(path) || CheckBearerToken(authorization, token).ok()) {
    done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_OK, nullptr);
    return;
  }
  // The message is static: gRPC copies it.
  static const std::string* const message = new std::string(kBadTokenMessage);
  done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_UNAUTHENTICATED,
       message->c_str());
}

void DestroyBearerToken(void* state) {
  delete static_cast<std::string*>(state);
}

// ServerCredentials for a TCP port built on gRPC's C credentials, because
// the C++ InsecureServerCredentials cannot carry an auth metadata
// processor: AddPortToServer (called by grpc::Server when the builder adds
// the port) creates the C credentials, TLS or plaintext, and attaches the
// bearer-token processor to them.
class TcpServerCredentialsImpl final : public grpc::ServerCredentials {
 public:
  explicit TcpServerCredentialsImpl(TcpSecurity security)
      : security_(std::move(security)) {}

  void SetAuthMetadataProcessor(
      const std::shared_ptr<grpc::AuthMetadataProcessor>& /*processor*/)
      override {
    // The port's processor is the bearer-token check; nothing replaces it.
    spdlog::error("TcpServerCredentials: SetAuthMetadataProcessor ignored");
  }

 private:
  bool tls() const { return !security_.tls_cert_pem.empty(); }

  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    grpc_server_credentials* credentials = nullptr;
    if (tls()) {
      grpc_ssl_pem_key_cert_pair pair{security_.tls_key_pem.c_str(),
                                      security_.tls_cert_pem.c_str()};
      grpc_ssl_server_certificate_config* config =
          grpc_ssl_server_certificate_config_create(nullptr, &pair, 1);
      grpc_ssl_server_credentials_options* options =
          grpc_ssl_server_credentials_create_options_using_config(
              GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE, config);
      credentials = grpc_ssl_server_credentials_create_with_options(options);
    } else {
      credentials = grpc_insecure_server_credentials_create();
    }
    if (credentials == nullptr) return 0;  // the builder reports the port
    if (!security_.bearer_token.empty()) {
      grpc_auth_metadata_processor processor{
          &ProcessBearerToken, &DestroyBearerToken,
          new std::string(security_.bearer_token)};
      grpc_server_credentials_set_auth_metadata_processor(credentials,
                                                          processor);
    }
    const int port =
        grpc_server_add_http2_port(server, addr.c_str(), credentials);
    grpc_server_credentials_release(credentials);
    return port;
  }

  bool IsInsecure() const override { return !tls(); }

  const TcpSecurity security_;
};

}  // namespace

bool ConstantTimeEquals(absl::string_view given, absl::string_view expected) {
  unsigned char difference = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g =
        i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    difference |= g ^ static_cast<unsigned char>(expected[i]);
  }
  return difference == 0;
}

absl::Status CheckBearerToken(
    const std::vector<absl::string_view>& authorization_values,
    absl::string_view token) {
  if (token.empty()) return absl::OkStatus();
  bool match = false;
  for (absl::string_view value : authorization_values) {
    if (value.size() < kBearerScheme.size() ||
        !absl::EqualsIgnoreCase(value.substr(0, kBearerScheme.size()),
                                kBearerScheme)) {
      continue;
    }
    // No early exit: every value costs the same comparison.
    match |= ConstantTimeEquals(value.substr(kBearerScheme.size()), token);
  }
  if (match) return absl::OkStatus();
  return absl::UnauthenticatedError(kBadTokenMessage);
}

bool IsExemptFromToken(absl::string_view method_path) {
  // Health probes (Kubernetes gRPC probes send no metadata) reveal nothing
  // but SERVING.
  return absl::StartsWith(method_path, "/grpc.health.v1.Health/");
}

std::shared_ptr<grpc::ServerCredentials> TcpServerCredentials(
    const TcpSecurity& security) {
  return std::make_shared<TcpServerCredentialsImpl>(security);
}

std::shared_ptr<grpc::ChannelCredentials> TcpChannelCredentials(
    const std::string& tls_ca_pem) {
  if (tls_ca_pem.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = tls_ca_pem;
  return grpc::SslCredentials(options);
}

void AddBearerToken(grpc::ClientContext& context, absl::string_view token) {
  if (token.empty()) return;
  context.AddMetadata(std::string(kAuthorizationKey),
                      absl::StrCat("Bearer ", token));
}

absl::StatusOr<std::string> ReadPemFile(absl::string_view flag,
                                        const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read ", path));
  }
  if (!absl::StrContains(text.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " holds no PEM block"));
  }
  return text.str();
}

}  // namespace canzona
