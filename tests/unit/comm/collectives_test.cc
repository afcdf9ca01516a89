// Every collective, for both implementations (in-process Gloo over TCP
// loopback with one communicator per thread, and the fake) and group sizes
// 1 to 4, on fresh random data with uneven and zero counts, compared
// bitwise with a straightforward reference.
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/base/dtype.h"
#include "server/comm/communicator.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/comm/comm_test_util.h"
#include "tests/unit/comm/group_factory.h"

namespace canzona::testing {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(10);

class CollectivesTest
    : public ::testing::TestWithParam<std::tuple<Backend, int>> {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(group_, MakeTestGroup(backend(), size(), kTimeout));
  }
  Backend backend() const { return std::get<0>(GetParam()); }
  int size() const { return std::get<1>(GetParam()); }
  Communicator* comm(int r) { return group_->comm(r); }

  std::mt19937 rng_{12345u + static_cast<unsigned>(size())};
  std::unique_ptr<TestGroup> group_;
};

TEST_P(CollectivesTest, RankAndSize) {
  for (int r = 0; r < size(); ++r) {
    EXPECT_EQ(comm(r)->rank(), r);
    EXPECT_EQ(comm(r)->size(), size());
  }
}

TEST_P(CollectivesTest, ReduceScatterVUnevenAndZeroCounts) {
  for (int trial = 0; trial < 4; ++trial) {
    // Last trial: every count zero (all ranks skip together).
    std::vector<int64_t> counts = trial == 3 ? std::vector<int64_t>(size(), 0)
                                             : RandomCounts(rng_, size(), 37);
    Buffers send(size()), recv(size());
    for (int r = 0; r < size(); ++r) {
      send[r] = ExactRandom(rng_, Sum(counts));
      recv[r].assign(counts[r], -1.0f);
    }
    RunOnRanks(size(), [&](int r) {
      EXPECT_OK(
          comm(r)->ReduceScatterV(send[r].data(), counts, recv[r].data()));
    });
    for (int r = 0; r < size(); ++r) {
      EXPECT_EQ(recv[r], RefReduceScatterV(send, counts, r))
          << "rank " << r << " trial " << trial;
    }
  }
}

TEST_P(CollectivesTest, ReduceScatterVInPlace) {
  std::vector<int64_t> counts = RandomCounts(rng_, size(), 20);
  Buffers send(size()), data(size());
  for (int r = 0; r < size(); ++r)
    send[r] = data[r] = ExactRandom(rng_, Sum(counts));
  RunOnRanks(size(), [&](int r) {
    EXPECT_OK(comm(r)->ReduceScatterV(data[r].data(), counts, data[r].data()));
  });
  for (int r = 0; r < size(); ++r) {
    std::vector<float> got(data[r].begin(), data[r].begin() + counts[r]);
    EXPECT_EQ(got, RefReduceScatterV(send, counts, r)) << "rank " << r;
  }
}

// One rank owns a whole large bucket (a plan's single-parameter bucket):
// the Gloo communicator then moves it in several rounds (its received
// copies stay a fraction of the bucket); the sums must not notice.
TEST_P(CollectivesTest, ReduceScatterVOfOneOwnerInManyRounds) {
  if (size() == 1) GTEST_SKIP() << "nothing to reduce";
  constexpr int64_t kBig = 1 << 20;
  for (int owner : {0, size() - 1}) {
    std::vector<int64_t> counts(size(), 0);
    counts[owner] = kBig;
    counts[(owner + 1) % size()] = 3;  // and a small neighbour
    Buffers send(size()), recv(size());
    for (int r = 0; r < size(); ++r) {
      send[r] = ExactRandom(rng_, Sum(counts));
      recv[r].assign(counts[r], -1.0f);
    }
    RunOnRanks(size(), [&](int r) {
      EXPECT_OK(
          comm(r)->ReduceScatterV(send[r].data(), counts, recv[r].data()));
    });
    for (int r = 0; r < size(); ++r) {
      EXPECT_EQ(recv[r], RefReduceScatterV(send, counts, r))
          << "rank " << r << " owner " << owner;
    }
  }
}

// bf16 / fp16 elements: sums accumulated in fp32 in rank order, rounded
// once; gathers move the 16-bit patterns untouched.
TEST_P(CollectivesTest, TypedSixteenBitReduceScatterAndAllGather) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const std::vector<int64_t> counts = RandomCounts(rng_, size(), 41);
    const int64_t total = Sum(counts);
    std::vector<std::vector<uint16_t>> send(size()), recv(size());
    std::uniform_real_distribution<float> value(-3.0f, 3.0f);
    for (int r = 0; r < size(); ++r) {
      std::vector<float> v(total);
      for (float& x : v) x = value(rng_);
      send[r].resize(total);
      RoundFromFloat(v.data(), total, dtype, send[r].data());
      recv[r].assign(counts[r], 0xFFFF);
    }
    RunOnRanks(size(), [&](int r) {
      EXPECT_OK(comm(r)->ReduceScatterVTyped(dtype, send[r].data(), counts,
                                             recv[r].data()));
    });
    int64_t at = 0;
    for (int r = 0; r < size(); ++r) {
      std::vector<float> sum(counts[r], 0.0f), part(counts[r]);
      for (int q = 0; q < size(); ++q) {
        WidenToFloat(dtype, send[q].data() + at, counts[r], part.data());
        for (int64_t i = 0; i < counts[r]; ++i) sum[i] += part[i];
      }
      std::vector<uint16_t> want(counts[r]);
      RoundFromFloat(sum.data(), counts[r], dtype, want.data());
      EXPECT_EQ(recv[r], want) << DTypeName(dtype) << " rank " << r;
      at += counts[r];
    }
    // Gather the reduced slices back: every rank holds every slice.
    std::vector<std::vector<uint16_t>> all(size(),
                                           std::vector<uint16_t>(total, 0));
    RunOnRanks(size(), [&](int r) {
      EXPECT_OK(comm(r)->AllGatherVTyped(dtype, recv[r].data(), counts,
                                         all[r].data()));
    });
    std::vector<uint16_t> joined;
    for (int r = 0; r < size(); ++r) {
      joined.insert(joined.end(), recv[r].begin(), recv[r].end());
    }
    for (int r = 0; r < size(); ++r) EXPECT_EQ(all[r], joined);
  }
}

TEST_P(CollectivesTest, AllGatherVUnevenAndZeroCounts) {
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<int64_t> counts = RandomCounts(rng_, size(), 41);
    Buffers send(size()), recv(size());
    for (int r = 0; r < size(); ++r) {
      send[r] = ExactRandom(rng_, counts[r]);
      recv[r].assign(Sum(counts), -1.0f);
    }
    RunOnRanks(size(), [&](int r) {
      EXPECT_OK(comm(r)->AllGatherV(send[r].data(), counts, recv[r].data()));
    });
    for (int r = 0; r < size(); ++r) {
      EXPECT_EQ(recv[r], RefAllGatherV(send)) << "rank " << r;
    }
  }
}

TEST_P(CollectivesTest, AllGatherVInPlace) {
  std::vector<int64_t> counts = RandomCounts(rng_, size(), 23);
  Buffers send(size()), recv(size());
  std::vector<int64_t> offset(size(), 0);
  for (int r = 0; r < size(); ++r) {
    send[r] = ExactRandom(rng_, counts[r]);
    if (r > 0) offset[r] = offset[r - 1] + counts[r - 1];
  }
  for (int r = 0; r < size(); ++r) {
    recv[r].assign(Sum(counts), -1.0f);
    std::copy(send[r].begin(), send[r].end(), recv[r].begin() + offset[r]);
  }
  RunOnRanks(size(), [&](int r) {
    EXPECT_OK(comm(r)->AllGatherV(recv[r].data() + offset[r], counts,
                                  recv[r].data()));
  });
  for (int r = 0; r < size(); ++r) {
    EXPECT_EQ(recv[r], RefAllGatherV(send)) << "rank " << r;
  }
}

TEST_P(CollectivesTest, AllToAllVUnevenAndZeroCounts) {
  for (int trial = 0; trial < 3; ++trial) {
    // send_counts[i][j]: rank i to rank j; rank j's recv_counts[i] mirror it.
    std::vector<std::vector<int64_t>> send_counts(size());
    for (auto& row : send_counts) row = RandomCounts(rng_, size(), 19);
    std::vector<std::vector<int64_t>> recv_counts(size(),
                                                  std::vector<int64_t>(size()));
    for (int i = 0; i < size(); ++i) {
      for (int j = 0; j < size(); ++j) recv_counts[j][i] = send_counts[i][j];
    }
    Buffers send(size()), recv(size());
    for (int r = 0; r < size(); ++r) {
      send[r] = ExactRandom(rng_, Sum(send_counts[r]));
      recv[r].assign(Sum(recv_counts[r]), -1.0f);
    }
    RunOnRanks(size(), [&](int r) {
      EXPECT_OK(comm(r)->AllToAllV(send[r].data(), send_counts[r],
                                   recv[r].data(), recv_counts[r]));
    });
    for (int r = 0; r < size(); ++r) {
      EXPECT_EQ(recv[r], RefAllToAllV(send, send_counts, r)) << "rank " << r;
    }
  }
}

TEST_P(CollectivesTest, AllToAllVAllZero) {
  std::vector<int64_t> zeros(size(), 0);
  RunOnRanks(size(), [&](int r) {
    EXPECT_OK(comm(r)->AllToAllV(nullptr, zeros, nullptr, zeros));
  });
}

TEST_P(CollectivesTest, AllReduce) {
  // 0, small, and one large enough for Gloo to split it into segments.
  for (int64_t count : {int64_t{0}, int64_t{7}, int64_t{1} << 18}) {
    Buffers data(size()), before(size());
    for (int r = 0; r < size(); ++r)
      before[r] = data[r] = ExactRandom(rng_, count);
    RunOnRanks(size(), [&](int r) {
      EXPECT_OK(comm(r)->AllReduce(data[r].data(), count));
    });
    std::vector<float> expected = RefAllReduce(before);
    for (int r = 0; r < size(); ++r) {
      EXPECT_TRUE(data[r] == expected) << "rank " << r << " count " << count;
    }
  }
}

TEST_P(CollectivesTest, BroadcastFromEveryRoot) {
  for (int root = 0; root < size(); ++root) {
    const int64_t count = 5 + root * 11;
    Buffers data(size());
    for (int r = 0; r < size(); ++r) data[r] = ExactRandom(rng_, count);
    const std::vector<float> expected = data[root];
    RunOnRanks(size(), [&](int r) {
      EXPECT_OK(comm(r)->Broadcast(data[r].data(), count, root));
    });
    for (int r = 0; r < size(); ++r) {
      EXPECT_EQ(data[r], expected) << "rank " << r << " root " << root;
    }
  }
  RunOnRanks(size(), [&](int r) {
    EXPECT_OK(comm(r)->Broadcast(nullptr, 0, size() - 1));
  });
}

TEST_P(CollectivesTest, Barrier) {
  RunOnRanks(size(), [&](int r) {
    for (int i = 0; i < 3; ++i) EXPECT_OK(comm(r)->Barrier());
  });
}

// Many different collectives back to back, as a step issues them: each must
// match only its own messages (Gloo: a fresh tag per call).
TEST_P(CollectivesTest, MixedSequenceStaysInOrder) {
  constexpr int kOps = 24;
  std::vector<std::vector<int64_t>> counts(kOps);
  std::vector<Buffers> in(kOps, Buffers(size()));
  for (int k = 0; k < kOps; ++k) {
    counts[k] = RandomCounts(rng_, size(), 9, /*with_zero=*/k % 2 == 0);
    for (int r = 0; r < size(); ++r) {
      in[k][r] = ExactRandom(rng_, k % 3 == 1 ? counts[k][r] : Sum(counts[k]));
    }
  }
  std::vector<Buffers> out(kOps, Buffers(size()));
  RunOnRanks(size(), [&](int r) {
    for (int k = 0; k < kOps; ++k) {
      std::vector<float>& o = out[k][r];
      switch (k % 3) {
        case 0:
          o.assign(counts[k][r], 0.0f);
          ASSERT_OK(
              comm(r)->ReduceScatterV(in[k][r].data(), counts[k], o.data()));
          break;
        case 1:
          o.assign(Sum(counts[k]), 0.0f);
          ASSERT_OK(comm(r)->AllGatherV(in[k][r].data(), counts[k], o.data()));
          break;
        case 2:
          o = in[k][r];
          ASSERT_OK(
              comm(r)->AllReduce(o.data(), static_cast<int64_t>(o.size())));
          break;
      }
    }
  });
  for (int k = 0; k < kOps; ++k) {
    for (int r = 0; r < size(); ++r) {
      std::vector<float> expected = k % 3 == 0
                                        ? RefReduceScatterV(in[k], counts[k], r)
                                    : k % 3 == 1 ? RefAllGatherV(in[k])
                                                 : RefAllReduce(in[k]);
      EXPECT_EQ(out[k][r], expected) << "op " << k << " rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BackendsAndSizes, CollectivesTest,
                         ::testing::Combine(::testing::Values(Backend::kFake,
                                                              Backend::kGloo),
                                            ::testing::Values(1, 2, 3, 4)),
                         [](const auto& info) {
                           return BackendName(std::get<0>(info.param)) +
                                  "Size" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Argument checks: INVALID_ARGUMENT naming the field, before any
// communication, and the communicator stays usable.
class ValidationTest : public ::testing::TestWithParam<Backend> {};

TEST_P(ValidationTest, RejectsBadArgumentsNamingTheField) {
  ASSERT_OK_AND_ASSIGN(auto group, MakeTestGroup(GetParam(), 2, kTimeout));
  Communicator* c = group->comm(0);
  std::vector<float> buf(16, 1.0f);
  const std::vector<int64_t> three = {1, 1, 1};
  const std::vector<int64_t> negative = {2, -1};
  const std::vector<int64_t> ok = {2, 3};
  auto invalid = [](const char* field) {
    return StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(field));
  };
  EXPECT_THAT(c->ReduceScatterV(buf.data(), three, buf.data()),
              invalid("counts has 3 entries"));
  EXPECT_THAT(c->ReduceScatterV(buf.data(), negative, buf.data()),
              invalid("counts[1] is negative"));
  EXPECT_THAT(c->ReduceScatterV(nullptr, ok, buf.data()), invalid("send"));
  EXPECT_THAT(c->ReduceScatterV(buf.data(), ok, nullptr), invalid("recv"));
  EXPECT_THAT(c->AllGatherV(nullptr, ok, buf.data()), invalid("send"));
  EXPECT_THAT(c->AllGatherV(buf.data(), ok, nullptr), invalid("recv"));
  EXPECT_THAT(c->AllGatherV(buf.data(), three, buf.data()), invalid("counts"));
  EXPECT_THAT(c->AllToAllV(buf.data(), three, buf.data(), ok),
              invalid("send_counts"));
  EXPECT_THAT(c->AllToAllV(buf.data(), ok, buf.data(), negative),
              invalid("recv_counts"));
  EXPECT_THAT(
      c->AllToAllV(buf.data(), ok, buf.data(), std::vector<int64_t>{1, 3}),
      invalid("send_counts[0]"));
  EXPECT_THAT(c->AllToAllV(nullptr, ok, buf.data(), ok), invalid("send"));
  EXPECT_THAT(c->AllReduce(buf.data(), -1), invalid("count"));
  EXPECT_THAT(c->AllReduce(nullptr, 4), invalid("data"));
  EXPECT_THAT(c->Broadcast(buf.data(), 4, 2), invalid("root"));
  EXPECT_THAT(c->Broadcast(buf.data(), 4, -1), invalid("root"));
  EXPECT_THAT(c->Broadcast(nullptr, 4, 0), invalid("data"));
  // Nothing was sent: the group still works.
  RunOnRanks(2, [&](int r) { EXPECT_OK(group->comm(r)->Barrier()); });
}

INSTANTIATE_TEST_SUITE_P(Backends, ValidationTest,
                         ::testing::Values(Backend::kFake, Backend::kGloo),
                         [](const auto& info) {
                           return BackendName(info.param);
                         });

}  // namespace
}  // namespace canzona::testing
