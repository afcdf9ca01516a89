#include "server/comm/gloo_communicator.h"

#include <net/if.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "gloo/allgatherv.h"
#include "gloo/allreduce.h"
#include "gloo/alltoallv.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/tcp/device.h"
#include "kernels/base/status_macros.h"
#include "server/comm/comm_args.h"
#include "server/comm/gloo_store.h"

namespace canzona {
namespace {

// Gloo builds unbound buffers from raw pointers and memcpy's zero-byte
// slices; a null pointer is allowed by our interface for empty slices, so
// hand Gloo a valid address instead (nothing is ever read or written
// through it).
float* NonNull(const float* ptr) {
  static float dummy = 0.0f;
  return ptr != nullptr ? const_cast<float*>(ptr) : &dummy;
}

// Timeouts and broken connections both surface as gloo::IoException; the
// message tells them apart ("Timed out waiting ...", "Read timeout",
// "Connect timeout", "Application timeout caused pair closure" vs
// "Connection closed by peer", "writev ...: Broken pipe").
absl::StatusCode IoCode(absl::string_view what) {
  std::string lower = absl::AsciiStrToLower(what);
  return absl::StrContains(lower, "timeout") ||
                 absl::StrContains(lower, "timed out")
             ? absl::StatusCode::kDeadlineExceeded
             : absl::StatusCode::kUnavailable;
}

// Runs `fn` (Gloo calls) and converts whatever Gloo throws into a Status
// whose message starts with `context`: this is the boundary past which no
// exception may travel.
template <typename Fn>
absl::Status CatchGloo(const std::string& context, Fn&& fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const gloo::IoException& e) {
    return absl::Status(IoCode(e.what()),
                        absl::StrCat(context, ": ", e.what()));
  } catch (const gloo::EnforceNotMet& e) {
    return absl::InternalError(
        absl::StrCat(context, ": Gloo check failed: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(context, ": ", e.what()));
  } catch (...) {
    return absl::UnknownError(
        absl::StrCat(context, ": unknown exception from Gloo"));
  }
}

void IgnoreSigpipeOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current;
    if (sigaction(SIGPIPE, nullptr, &current) == 0 &&
        current.sa_handler == SIG_DFL) {
      signal(SIGPIPE, SIG_IGN);
    }
  });
}

// Debian's Gloo snapshot dereferences a null getaddrinfo(3) result when
// the hostname does not resolve (it checks for -1, but getaddrinfo returns
// EAI_* codes), i.e. it segfaults. Resolve first, the same way it will.
absl::Status CheckBindAddress(const GlooOptions& options) {
  if (!options.iface.empty()) {
    if (if_nametoindex(options.iface.c_str()) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.iface '", options.iface, "' is not a network interface"));
    }
    return absl::OkStatus();
  }
  struct addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* result = nullptr;
  const int rv =
      getaddrinfo(options.hostname.c_str(), nullptr, &hints, &result);
  if (rv != 0 || result == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.hostname '", options.hostname,
                     "' does not resolve: ", gai_strerror(rv)));
  }
  freeaddrinfo(result);
  return absl::OkStatus();
}

void SumFloat(void* out, const void* a, const void* b, size_t n) {
  gloo::sum<float>(out, a, b, n);
}

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(std::string group, int rank, int size,
                   std::chrono::milliseconds timeout,
                   std::shared_ptr<gloo::transport::Device> device,
                   std::shared_ptr<gloo::rendezvous::Context> context)
      : group_(std::move(group)),
        rank_(rank),
        size_(size),
        timeout_(timeout),
        device_(std::move(device)),
        context_(std::move(context)) {}

  ~GlooCommunicator() override {
    // The context's pairs must close before the device (and its loop
    // thread) goes away.
    context_.reset();
    device_.reset();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status ReduceScatterV(const float* send,
                              absl::Span<const int64_t> counts,
                              float* recv) override {
    constexpr char kOp[] = "ReduceScatterV";
    CANZONA_RETURN_IF_ERROR(CheckUsable(kOp));
    CANZONA_RETURN_IF_ERROR(
        comm_args::CheckReduceScatterV(rank_, size_, send, counts, recv));
    // Every rank holds the same counts, so every rank skips together.
    if (comm_args::Total(counts) == 0) return absl::OkStatus();
    const int64_t mine = counts[rank_];
    if (size_ == 1) {
      // memmove/memcpy take no null pointer, even for zero bytes.
      if (recv != send && mine > 0) {
        std::memmove(recv, send, mine * sizeof(float));
      }
      return absl::OkStatus();
    }
    // Slice r of every rank goes to rank r (alltoallv); rank r then sums the
    // size_ received copies in rank order. Same bytes on the wire as a ring
    // reduce-scatter ((P-1)/P of the buffer per rank), one round, and the
    // summation order is fixed, so results are bitwise reproducible and
    // match the fake. Scratch grows once and is reused.
    scratch_.resize(static_cast<size_t>(mine) * size_);
    std::vector<int64_t> send_counts(counts.begin(), counts.end());
    std::vector<int64_t> recv_counts(size_, mine);
    CANZONA_RETURN_IF_ERROR(Run(kOp, [&] {
      gloo::AlltoallvOptions opts(context_);
      opts.setInput(NonNull(send), send_counts);
      opts.setOutput(NonNull(scratch_.data()), recv_counts);
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::alltoallv(opts);
    }));
    // `recv` may alias `send`: everything needed is in scratch_ by now.
    if (mine == 0) return absl::OkStatus();
    std::memcpy(recv, scratch_.data(), mine * sizeof(float));
    for (int q = 1; q < size_; ++q) {
      const float* slice = scratch_.data() + static_cast<size_t>(q) * mine;
      for (int64_t i = 0; i < mine; ++i) recv[i] += slice[i];
    }
    return absl::OkStatus();
  }

  absl::Status AllGatherV(const float* send, absl::Span<const int64_t> counts,
                          float* recv) override {
    constexpr char kOp[] = "AllGatherV";
    CANZONA_RETURN_IF_ERROR(CheckUsable(kOp));
    CANZONA_RETURN_IF_ERROR(
        comm_args::CheckAllGatherV(rank_, size_, send, counts, recv));
    if (comm_args::Total(counts) == 0) return absl::OkStatus();
    float* mine = recv + comm_args::Offset(counts, rank_);
    if (size_ == 1) {
      if (mine != send) std::memmove(mine, send, counts[0] * sizeof(float));
      return absl::OkStatus();
    }
    std::vector<size_t> elements(counts.begin(), counts.end());
    return Run(kOp, [&] {
      gloo::AllgathervOptions opts(context_);
      // In place (send already in its slot of recv): no input, Gloo then
      // sends straight from the output buffer.
      if (send != mine) opts.setInput(NonNull(send), counts[rank_]);
      opts.setOutput(NonNull(recv), elements);
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::allgatherv(opts);
    });
  }

  absl::Status AllToAllV(const float* send,
                         absl::Span<const int64_t> send_counts, float* recv,
                         absl::Span<const int64_t> recv_counts) override {
    constexpr char kOp[] = "AllToAllV";
    CANZONA_RETURN_IF_ERROR(CheckUsable(kOp));
    CANZONA_RETURN_IF_ERROR(comm_args::CheckAllToAllV(
        rank_, size_, send, send_counts, recv, recv_counts));
    if (size_ == 1) {
      if (send_counts[0] > 0) {
        std::memmove(recv, send, send_counts[0] * sizeof(float));
      }
      return absl::OkStatus();
    }
    // No early return on all-zero local counts: peers still expect this
    // rank's (empty) messages, and only they know their own counts.
    std::vector<int64_t> in(send_counts.begin(), send_counts.end());
    std::vector<int64_t> out(recv_counts.begin(), recv_counts.end());
    return Run(kOp, [&] {
      gloo::AlltoallvOptions opts(context_);
      opts.setInput(NonNull(send), in);
      opts.setOutput(NonNull(recv), out);
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::alltoallv(opts);
    });
  }

  absl::Status AllReduce(float* data, int64_t count) override {
    constexpr char kOp[] = "AllReduce";
    CANZONA_RETURN_IF_ERROR(CheckUsable(kOp));
    CANZONA_RETURN_IF_ERROR(comm_args::CheckAllReduce(data, count));
    if (count == 0 || size_ == 1) return absl::OkStatus();
    return Run(kOp, [&] {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(data, static_cast<size_t>(count));
      opts.setReduceFunction(&SumFloat);
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::allreduce(opts);
    });
  }

  absl::Status Broadcast(float* data, int64_t count, int root) override {
    constexpr char kOp[] = "Broadcast";
    CANZONA_RETURN_IF_ERROR(CheckUsable(kOp));
    CANZONA_RETURN_IF_ERROR(
        comm_args::CheckBroadcast(size_, data, count, root));
    if (count == 0 || size_ == 1) return absl::OkStatus();
    return Run(kOp, [&] {
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(data, static_cast<size_t>(count));
      opts.setRoot(root);
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
    });
  }

  absl::Status Barrier() override {
    constexpr char kOp[] = "Barrier";
    CANZONA_RETURN_IF_ERROR(CheckUsable(kOp));
    if (size_ == 1) return absl::OkStatus();
    return Run(kOp, [&] {
      gloo::BarrierOptions opts(context_);
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

  void Abort() override {
    {
      absl::MutexLock lock(&mu_);
      if (!broken_.ok()) return;
      broken_ = absl::CancelledError(
          absl::StrCat("rank ", rank_, " of group '", group_, "' aborted"));
    }
    // Hard close (RST) of every connection: peers blocked on this rank see
    // their connection drop and fail now rather than at their timeout.
    // Gloo's pair close is mutex-protected against the caller thread.
    CloseConnections();
  }

 private:
  std::string Where(const char* op) const {
    return absl::StrCat(op, " on rank ", rank_, " of group '", group_,
                        "' (size ", size_, ")");
  }

  absl::Status CheckUsable(const char* op) {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat(Where(op),
                     ": communicator is unusable after an earlier failure or "
                     "Abort; create a new one: ",
                     broken_.ToString()));
  }

  // Runs a Gloo collective; any failure breaks the communicator (a
  // half-done collective may have left messages in flight) and closes its
  // connections: Gloo only closes them all on a timeout, so after a broken
  // connection to one peer the others would otherwise wait for us until
  // their own timeout.
  template <typename Fn>
  absl::Status Run(const char* op, Fn&& fn) {
    absl::Status status = CatchGloo(Where(op), std::forward<Fn>(fn));
    if (!status.ok()) {
      {
        absl::MutexLock lock(&mu_);
        if (broken_.ok()) broken_ = status;
      }
      CloseConnections();
    }
    return status;
  }

  void CloseConnections() {
    CatchGloo("close", [&] { context_->closeConnections(); }).IgnoreError();
  }

  // Gloo matches messages by slot = (collective kind, tag); a fresh tag per
  // call keeps a late message of one collective from completing another.
  // All ranks issue the same calls, so their counters agree.
  uint32_t NextTag() { return next_tag_++; }

  const std::string group_;
  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  uint32_t next_tag_ = 0;
  std::vector<float> scratch_;
  absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(
    KvStore* store, const std::string& group_prefix, int rank, int size,
    const GlooOptions& options) {
  if (store == nullptr) {
    return absl::InvalidArgumentError("CreateGlooCommunicator: store is null");
  }
  if (group_prefix.empty()) {
    return absl::InvalidArgumentError(
        "CreateGlooCommunicator: group_prefix is empty");
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CreateGlooCommunicator: rank ", rank, " / size ", size,
        " is not a valid position (need 0 <= rank < size, size >= 1)"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "CreateGlooCommunicator: options.timeout must be positive");
  }
  if (options.hostname.empty() && options.iface.empty()) {
    return absl::InvalidArgumentError(
        "CreateGlooCommunicator: options.hostname and options.iface are both "
        "empty");
  }
  CANZONA_RETURN_IF_ERROR(CheckBindAddress(options));
  IgnoreSigpipeOnce();
  const std::chrono::milliseconds timeout =
      std::max(std::chrono::milliseconds(1),
               absl::ToChronoMilliseconds(options.timeout));
  const std::string where =
      absl::StrCat("CreateGlooCommunicator(group '", group_prefix, "', rank ",
                   rank, " of ", size, ")");

  std::shared_ptr<gloo::transport::Device> device;
  absl::Status status = CatchGloo(where, [&] {
    gloo::transport::tcp::attr attr;
    if (!options.iface.empty()) {
      attr.iface = options.iface;
    } else {
      attr.hostname = options.hostname;
    }
    device = gloo::transport::tcp::CreateDevice(attr);
  });
  if (!status.ok()) {
    // Only our options reach CreateDevice: a failure means a bad address.
    return absl::InvalidArgumentError(absl::StrCat(
        "options.hostname '", options.hostname, "' / options.iface '",
        options.iface, "': ", status.message()));
  }

  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  GlooStore gloo_store(store, group_prefix + "/", options.timeout);
  status = CatchGloo(where, [&] {
    context->setTimeout(timeout);
    context->connectFullMesh(gloo_store, device);
  });
  if (!status.ok()) {
    // Prefer the store's own status (DEADLINE_EXCEEDED naming the key of
    // the rank that never arrived) over Gloo's rethrown text.
    absl::Status store_status = gloo_store.first_error();
    if (!store_status.ok()) {
      return absl::Status(
          store_status.code(),
          absl::StrCat(where, ": rendezvous: ", store_status.message()));
    }
    return status;
  }
  return std::unique_ptr<Communicator>(
      new GlooCommunicator(group_prefix, rank, size, timeout, std::move(device),
                           std::move(context)));
}

}  // namespace canzona
