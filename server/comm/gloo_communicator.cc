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
#include "gloo/transport/unbound_buffer.h"
#include "gloo/types.h"
#include "kernels/base/status_macros.h"
#include "server/comm/comm_args.h"
#include "server/comm/gloo_store.h"

namespace canzona {
namespace {

// Gloo builds unbound buffers from raw pointers and memcpy's zero-byte
// slices; a null pointer is allowed by our interface for empty slices, so
// hand Gloo a valid address instead (nothing is ever read or written
// through it).
template <typename T>
T* NonNull(const void* ptr) {
  static T dummy{};
  return ptr != nullptr ? static_cast<T*>(const_cast<void*>(ptr)) : &dummy;
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

// Our own slot prefix for the chunked reduce-scatter's point-to-point
// messages (Gloo's collectives use 0x01-0x08; a fresh tag per round keeps
// rounds apart).
constexpr uint8_t kReduceScatterSlot = 0x31;

// Gloo's waits return false when the buffer's operation was aborted (a
// closed connection); timeouts and broken pairs throw themselves.
void WaitOrThrow(bool completed) {
  if (!completed) {
    throw gloo::IoException(
        "point-to-point transfer aborted (connection closed)");
  }
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

  // The float forms stay visible beside the typed overrides.
  using Communicator::AllGatherV;
  using Communicator::ReduceScatterV;
  absl::Status ReduceScatterVTyped(DType dtype, const void* send,
                                   absl::Span<const int64_t> counts,
                                   void* recv) override {
    constexpr char kOp[] = "ReduceScatterV";
    CANZONA_RETURN_IF_ERROR(CheckUsable(kOp));
    CANZONA_RETURN_IF_ERROR(
        comm_args::CheckReduceScatterV(rank_, size_, send, counts, recv));
    // Every rank holds the same counts, so every rank skips together.
    if (comm_args::Total(counts) == 0) return absl::OkStatus();
    const int64_t mine = counts[rank_];
    const size_t unit = DTypeBytes(dtype);
    if (size_ == 1) {
      // memmove/memcpy take no null pointer, even for zero bytes.
      if (recv != send && mine > 0) std::memmove(recv, send, mine * unit);
      return absl::OkStatus();
    }
    // Slice r of every rank goes to rank r, which sums the size_ copies in
    // rank order: the bytes of a ring reduce-scatter ((P-1)/P of the
    // buffer per rank), a fixed summation order (bitwise reproducible, the
    // fake's), in rounds of `chunk` elements of each slice so that the
    // received copies (scratch_) stay a fraction of a bucket, however
    // unevenly the slices are cut. A `recv` that overlaps `send` other than
    // at my own slice gets the sums at the end (later rounds still send
    // from there); the rounds depend on the counts alone, never on local
    // pointers, so every rank runs the same ones.
    const int64_t total = comm_args::Total(counts);
    const int64_t offset = comm_args::Offset(counts, rank_);
    const char* in = static_cast<const char*>(send);
    char* const target = static_cast<char*>(recv);
    const bool overlaps = mine > 0 && target != in + offset * unit &&
                          target < in + total * unit &&
                          in < target + mine * unit;
    std::vector<char> held(overlaps ? mine * unit : 0);
    char* out = overlaps ? held.data() : target;
    int64_t largest = 0;
    for (int64_t c : counts) largest = std::max(largest, c);
    const int64_t chunk = GlooReduceScatterChunk(counts, dtype);
    scratch_.resize(static_cast<size_t>(chunk) * size_ * unit);
    for (int64_t start = 0; start < largest; start += chunk) {
      auto piece = [&](int64_t count) {
        return std::clamp<int64_t>(count - start, 0, chunk);
      };
      const int64_t n = piece(mine);
      char* copies = scratch_.data();
      CANZONA_RETURN_IF_ERROR(Run(kOp, [&] {
        auto source = context_->createUnboundBuffer(
            const_cast<char*>(NonNull<char>(in)), total * unit);
        auto sink = context_->createUnboundBuffer(NonNull<char>(copies),
                                                  scratch_.size());
        const uint64_t slot = gloo::Slot::build(kReduceScatterSlot, NextTag());
        int sends = 0, recvs = 0;
        int64_t at = 0;
        for (int q = 0; q < size_; ++q) {
          const int64_t theirs = piece(counts[q]);
          if (q != rank_ && theirs > 0) {
            source->send(q, slot, (at + start) * unit, theirs * unit);
            ++sends;
          }
          if (q != rank_ && n > 0) {
            sink->recv(q, slot, q * chunk * unit, n * unit);
            ++recvs;
          }
          at += counts[q];
        }
        for (int i = 0; i < sends; ++i) WaitOrThrow(source->waitSend(timeout_));
        for (int i = 0; i < recvs; ++i) WaitOrThrow(sink->waitRecv(timeout_));
      }));
      if (n == 0) continue;
      // My own copy joins the others, then the sum in rank order.
      std::memcpy(copies + rank_ * chunk * unit, in + (offset + start) * unit,
                  n * unit);
      std::vector<const void*> parts(size_);
      for (int q = 0; q < size_; ++q) parts[q] = copies + q * chunk * unit;
      comm_args::SumInRankOrder(dtype, parts, n, out + start * unit);
    }
    if (overlaps) std::memcpy(target, held.data(), held.size());
    return absl::OkStatus();
  }

  absl::Status AllGatherVTyped(DType dtype, const void* send,
                               absl::Span<const int64_t> counts,
                               void* recv) override {
    constexpr char kOp[] = "AllGatherV";
    CANZONA_RETURN_IF_ERROR(CheckUsable(kOp));
    CANZONA_RETURN_IF_ERROR(
        comm_args::CheckAllGatherV(rank_, size_, send, counts, recv));
    if (comm_args::Total(counts) == 0) return absl::OkStatus();
    const size_t unit = DTypeBytes(dtype);
    char* mine =
        static_cast<char*>(recv) + comm_args::Offset(counts, rank_) * unit;
    if (size_ == 1) {
      if (mine != send) std::memmove(mine, send, counts[0] * unit);
      return absl::OkStatus();
    }
    std::vector<size_t> elements(counts.begin(), counts.end());
    return Run(kOp, [&] {
      gloo::AllgathervOptions opts(context_);
      // In place (send already in its slot of recv): no input, Gloo then
      // sends straight from the output buffer.
      if (unit == sizeof(float)) {
        if (send != mine) opts.setInput(NonNull<float>(send), counts[rank_]);
        opts.setOutput(NonNull<float>(recv), elements);
      } else {
        if (send != mine) opts.setInput(NonNull<uint16_t>(send), counts[rank_]);
        opts.setOutput(NonNull<uint16_t>(recv), elements);
      }
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
      opts.setInput(NonNull<float>(send), in);
      opts.setOutput(NonNull<float>(recv), out);
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
  std::vector<char> scratch_;  // ReduceScatterV's received slices
  absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

int64_t GlooReduceScatterChunk(absl::Span<const int64_t> counts, DType dtype) {
  const int64_t size = static_cast<int64_t>(counts.size());
  int64_t total = 0, largest = 0;
  for (int64_t c : counts) {
    total += c;
    largest = std::max(largest, c);
  }
  if (size <= 1 || largest == 0) return std::max<int64_t>(largest, 1);
  // size copies of a chunk: a quarter of the bucket (four rounds for even
  // slices: the bytes are the same, only the synchronizations add up), at
  // least 1 MiB (fewer, cheaper rounds for small buckets) and at most
  // 256 MiB.
  const int64_t unit = DTypeBytes(dtype);
  constexpr int64_t kMinScratchBytes = int64_t{1} << 20;
  constexpr int64_t kMaxScratchBytes = int64_t{256} << 20;
  int64_t chunk = (total + 4 * size - 1) / (4 * size);
  chunk = std::max(chunk, kMinScratchBytes / (size * unit));
  chunk = std::min(chunk, kMaxScratchBytes / (size * unit));
  return std::clamp<int64_t>(chunk, 1, largest);
}

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
