// How FakeNcclApi runs what its streams hold (fake_nccl_api.h): each
// stream in order, an event wait once its record is done, a collective
// once every rank of the communicator has armed its part, and in data
// mode the collective's arithmetic in rank order.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/base/dtype.h"
#include "server/comm/comm_args.h"
#include "tests/unit/comm/fake_nccl_api.h"

namespace canzona::testing {

namespace {

const char* KindName(int kind) {
  static const char* const kNames[] = {
      "ncclReduce",    "ncclBroadcast", "ncclReduceScatter", "ncclAllGather",
      "ncclAllReduce", "ncclSend",      "ncclRecv"};
  return kNames[kind];
}

}  // namespace

void FakeNcclApi::PushLocked(NcclStream stream, std::unique_ptr<Entry> entry) {
  StreamState& s = streams_[stream];
  s.queue.push_back(std::move(entry));
  ++s.enqueued;
}

bool FakeNcclApi::Armed(const Op* op) {
  return op != nullptr && op->entry != nullptr && op->entry->armed;
}

void FakeNcclApi::ProgressLocked() {
  bool changed = true;
  while (changed) {
    changed = false;
    for (auto& [stream, s] : streams_) {
      while (!s.queue.empty()) {
        Entry* head = s.queue.front().get();
        if (head->hang) break;
        bool complete = true;
        if (head->local) {
          if (options_.simulate_data) head->local();
        } else if (options_.simulate_data) {
          head->armed = true;
          for (auto& op : head->ops) {
            if (!op->done && !TryRunLocked(op.get())) complete = false;
          }
        }
        if (!complete) break;
        s.queue.pop_front();
        ++s.completed;
        changed = true;
      }
    }
  }
}

void FakeNcclApi::ProgressStreamLocked(NcclStream stream, int64_t target) {
  StreamState& s = streams_[stream];
  while (s.completed < target && !s.queue.empty()) {
    Entry* head = s.queue.front().get();
    if (!head->local || head->hang) {
      ProgressLocked();
      return;
    }
    if (options_.simulate_data) head->local();
    s.queue.pop_front();
    ++s.completed;
  }
}

bool FakeNcclApi::TryRunLocked(Op* op) {
  World* world = op->comm->world;
  if (op->comm->aborted || !world->error.ok()) return false;
  const int me = op->comm->rank;
  if (op->kind == Kind::kSend || op->kind == Kind::kRecv) {
    // Find this op's pair.
    for (auto it = world->p2p.begin(); it != world->p2p.end(); ++it) {
      auto& [send, recv] = it->second;
      if (send != op && recv != op) continue;
      if (!Armed(send) || !Armed(recv)) return false;
      if (send->count != recv->count) {
        world->error = absl::InternalError(absl::StrCat(
            "fake NCCL: rank ", std::get<0>(it->first), " sends ", send->count,
            " elements to rank ", std::get<1>(it->first), ", which receives ",
            recv->count));
        return false;
      }
      if (send->count > 0) {
        std::memmove(recv->recv, send->send,
                     static_cast<size_t>(send->count) *
                         DTypeBytes(FromNcclDataType(send->dtype)));
      }
      send->done = recv->done = true;
      world->p2p.erase(it);
      return true;
    }
    return false;
  }
  for (auto it = world->collectives.begin(); it != world->collectives.end();
       ++it) {
    std::vector<Op*>& ops = it->second;
    if (ops[me] != op) continue;
    for (Op* o : ops) {
      if (!Armed(o)) return false;
    }
    for (Op* o : ops) {
      if (o->kind != op->kind || o->count != op->count || o->root != op->root ||
          o->dtype != op->dtype) {
        world->error = absl::InternalError(absl::StrCat(
            "fake NCCL: collective #", it->first,
            " differs across ranks: ", KindName(static_cast<int>(op->kind)),
            "(count ", op->count, ", root ", op->root, ") on rank ", me, " vs ",
            KindName(static_cast<int>(o->kind)), "(count ", o->count, ", root ",
            o->root, ") on rank ", o->comm->rank));
        return false;
      }
    }
    RunCollective(ops);
    for (Op* o : ops) o->done = true;
    world->collectives.erase(it);
    return true;
  }
  return false;
}

void FakeNcclApi::RunCollective(const std::vector<Op*>& ops) {
  const int n = static_cast<int>(ops.size());
  const Op& first = *ops[0];
  const int64_t count = first.count;
  const DType dtype = FromNcclDataType(first.dtype);
  const int64_t unit = DTypeBytes(dtype);
  // Sums accumulate in fp32 in rank order and round once (as the Gloo
  // communicator; real NCCL rounds 16-bit partial sums on the way).
  auto sum_at = [&](int64_t offset) {
    std::vector<const void*> parts;
    for (const Op* o : ops) parts.push_back(o->send + offset * unit);
    std::vector<char> out(static_cast<size_t>(count * unit));
    comm_args::SumInRankOrder(dtype, parts, count, out.data());
    return out;
  };
  auto write = [&](char* dst, const std::vector<char>& v) {
    if (!v.empty()) std::memmove(dst, v.data(), v.size());
  };
  switch (first.kind) {
    case Kind::kAllReduce: {
      std::vector<char> sum = sum_at(0);
      for (const Op* o : ops) write(o->recv, sum);
      break;
    }
    case Kind::kReduce: {
      std::vector<char> sum = sum_at(0);
      write(ops[first.root]->recv, sum);
      break;
    }
    case Kind::kBroadcast: {
      const char* src = ops[first.root]->send;
      std::vector<char> v(src, src + count * unit);
      for (const Op* o : ops) write(o->recv, v);
      break;
    }
    case Kind::kReduceScatter: {
      std::vector<std::vector<char>> parts;
      for (int r = 0; r < n; ++r) parts.push_back(sum_at(r * count));
      for (int r = 0; r < n; ++r) write(ops[r]->recv, parts[r]);
      break;
    }
    case Kind::kAllGather: {
      std::vector<char> all;
      for (const Op* o : ops) {
        all.insert(all.end(), o->send, o->send + count * unit);
      }
      for (const Op* o : ops) write(o->recv, all);
      break;
    }
    case Kind::kSend:
    case Kind::kRecv:
      break;
  }
}

}  // namespace canzona::testing
