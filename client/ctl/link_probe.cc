#include "client/ctl/link_probe.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/base/status_macros.h"
#include "server/comm/gloo_communicator.h"
#include "server/control/kv_store.h"

namespace canzona::ctl {
namespace {

using Op = std::function<absl::Status(Communicator&)>;

double Fastest(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::min_element(v.begin(), v.end());
}

// Runs `op` on `ranks` Gloo ranks (threads) repeatedly for about
// `min_time`, a barrier before each call; rank 0's fastest call (the link
// without interference: other work on a shared machine is the simulator's
// background, hardware_profile.h).
absl::StatusOr<double> TimeCollective(const LoopbackOptions& o, int ranks,
                                      const std::string& name, const Op& op) {
  InMemoryKvStore store;
  GlooOptions gloo;
  gloo.hostname = o.host;
  gloo.timeout = absl::Seconds(60);
  const std::string prefix = absl::StrCat("calibrate/", name);
  std::vector<std::unique_ptr<Communicator>> comms(ranks);
  std::vector<absl::Status> status(ranks);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        auto c = CreateGlooCommunicator(&store, prefix, r, ranks, gloo);
        if (c.ok()) {
          comms[r] = *std::move(c);
        } else {
          status[r] = c.status();
        }
      });
    }
    for (std::thread& t : threads) t.join();
  }
  for (const absl::Status& s : status) CANZONA_RETURN_IF_ERROR(s);
  // Rank 0 decides when to stop and tells the others with the barrier's
  // partner, a broadcast of one flag, so every rank runs the same calls.
  std::vector<double> times;
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      Communicator& c = *comms[r];
      const absl::Time end = absl::Now() + absl::Seconds(o.min_time);
      for (int k = 0;; ++k) {
        float more = (k < 5 || absl::Now() < end) && k < 100000 ? 1.f : 0.f;
        absl::Status s = c.Broadcast(&more, 1, 0);
        if (s.ok() && more == 0) break;
        if (s.ok()) s = c.Barrier();
        const absl::Time start = absl::Now();
        if (s.ok()) s = op(c);
        if (!s.ok()) {
          status[r] = s;
          return;
        }
        if (r == 0 && k > 0) {
          times.push_back(absl::ToDoubleSeconds(absl::Now() - start));
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) CANZONA_RETURN_IF_ERROR(s);
  return Fastest(times);
}

// An all-gather-v of one float from every rank.
Op TinyAllGather(int ranks) {
  return [ranks](Communicator& c) {
    std::vector<float> out(ranks, 0.f);
    const float mine = 1.f;
    const std::vector<int64_t> counts(ranks, 1);
    return c.AllGatherV(&mine, counts, out.data());
  };
}

// An all-to-all-v in which every rank sends `bytes` in total, or with
// `one_way` only rank 0, to rank 1. The buffers are allocated (and
// touched) once, outside the timed calls.
Op BigAllToAll(int ranks, int64_t bytes, bool one_way = false) {
  const int64_t per_peer = std::max<int64_t>(1, bytes / 4 / (ranks - 1));
  auto buffers = std::make_shared<std::vector<std::vector<float>>>();
  for (int r = 0; r < 2 * ranks; ++r) {
    buffers->emplace_back(static_cast<size_t>(per_peer) * ranks, 1.f);
  }
  return [ranks, per_peer, buffers, one_way](Communicator& c) {
    std::vector<int64_t> send(ranks, per_peer), recv(ranks, per_peer);
    send[c.rank()] = recv[c.rank()] = 0;
    if (one_way) {
      std::fill(send.begin(), send.end(), 0);
      std::fill(recv.begin(), recv.end(), 0);
      if (c.rank() == 0) send[1] = per_peer;
      if (c.rank() == 1) recv[0] = per_peer;
    }
    return c.AllToAllV((*buffers)[2 * c.rank()].data(), send,
                       (*buffers)[2 * c.rank() + 1].data(), recv);
  };
}

}  // namespace

absl::StatusOr<LoopbackLink> MeasureLoopback(const LoopbackOptions& o) {
  if (o.ranks < 3) {
    return absl::InvalidArgumentError("--ranks must be at least 3");
  }
  const int n = o.ranks;
  CANZONA_ASSIGN_OR_RETURN(double tiny2,
                           TimeCollective(o, 2, "tiny2", TinyAllGather(2)));
  CANZONA_ASSIGN_OR_RETURN(double tinyn,
                           TimeCollective(o, n, "tinyn", TinyAllGather(n)));
  const double bytes = static_cast<double>(o.large_bytes);
  CANZONA_ASSIGN_OR_RETURN(
      double one_way,
      TimeCollective(o, 2, "oneway", BigAllToAll(2, o.large_bytes, true)));
  CANZONA_ASSIGN_OR_RETURN(
      double big2, TimeCollective(o, 2, "big2", BigAllToAll(2, o.large_bytes)));
  CANZONA_ASSIGN_OR_RETURN(
      double bign, TimeCollective(o, n, "bign", BigAllToAll(n, o.large_bytes)));
  LoopbackLink link;
  // Keep both terms positive (the profile requires it): at least 10% of
  // the 2-rank call each.
  link.hop_us = std::max(1e6 * (tinyn - tiny2) / (n - 2), 0.1e6 * tiny2);
  link.launch_us = std::max(1e6 * tiny2 - link.hop_us, 0.1e6 * tiny2);
  const double fixed = (link.launch_us + link.hop_us) * 1e-6;
  auto transfer = [&](double t) { return std::max(t - fixed, 1e-9); };
  // One way: the per-rank rate. Both ways in one pair: the pair's cap when
  // slower than the per-rank rate allows. n ranks each sending `bytes` to
  // n-1 peers: the node's cap when slower than both.
  const double rank_bps = bytes / transfer(one_way);
  link.bandwidth_gbps = rank_bps / 1e9;
  double pair_bps = 0;
  if (transfer(big2) > bytes / rank_bps * 1.05) {
    pair_bps = 2 * bytes / transfer(big2);
    link.pair_gbps = pair_bps / 1e9;
  }
  double modelled = bytes / rank_bps;
  if (pair_bps > 0) {
    modelled = std::max(modelled, 2 * bytes / (n - 1) / pair_bps);
  }
  if (transfer(bign) > modelled * 1.05) {
    link.aggregate_gbps = n * bytes / transfer(bign) / 1e9;
  }
  link.raw = {{"ranks", n},
              {"allgatherv_1_float_2_ranks_s", tiny2},
              {"allgatherv_1_float_n_ranks_s", tinyn},
              {"alltoallv_bytes_per_rank", o.large_bytes},
              {"one_way_2_ranks_s", one_way},
              {"alltoallv_2_ranks_s", big2},
              {"alltoallv_n_ranks_s", bign}};
  return link;
}

double MeasureMemoryBandwidth(double min_time) {
  const size_t bytes = size_t{64} << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  std::vector<double> times;
  const absl::Time end = absl::Now() + absl::Seconds(min_time);
  for (int k = 0; k < 3 || absl::Now() < end; ++k) {
    const absl::Time start = absl::Now();
    std::memcpy(k % 2 ? a.data() : b.data(), k % 2 ? b.data() : a.data(),
                bytes);
    times.push_back(absl::ToDoubleSeconds(absl::Now() - start));
  }
  return 2.0 * bytes / Fastest(times) / 1e9;
}

}  // namespace canzona::ctl
