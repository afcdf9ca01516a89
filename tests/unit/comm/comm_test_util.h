// Shared helpers of the communicator tests: exact random data, reference
// results computed the obvious way, and running one function per rank on
// its own thread.
//
// Data are multiples of 2^-12 in [-8, 8]: sums of up to 16 of them are exact
// in float32, so results compare bitwise whatever order an algorithm sums.
//
// Thread-safety: functions only; RunOnRanks joins its threads.
#ifndef CANZONA_TESTS_UNIT_COMM_COMM_TEST_UTIL_H_
#define CANZONA_TESTS_UNIT_COMM_COMM_TEST_UTIL_H_

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace canzona::testing {

using Buffers = std::vector<std::vector<float>>;  // one buffer per rank

inline std::vector<float> ExactRandom(std::mt19937& rng, int64_t n) {
  std::uniform_int_distribution<int> k(-8 * 4096, 8 * 4096);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(k(rng)) / 4096.0f;
  return v;
}

// Per-rank counts in [0, max], with at least one zero when size > 1 and
// `with_zero` (uneven slices and empty ones are the interesting cases).
inline std::vector<int64_t> RandomCounts(std::mt19937& rng, int size,
                                         int64_t max, bool with_zero = true) {
  std::uniform_int_distribution<int64_t> c(0, max);
  std::vector<int64_t> counts(size);
  for (int64_t& x : counts) x = c(rng);
  if (with_zero && size > 1) counts[rng() % size] = 0;
  return counts;
}

inline int64_t Sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

inline std::vector<float> RefReduceScatterV(const Buffers& send,
                                            const std::vector<int64_t>& counts,
                                            int rank) {
  int64_t off = 0;
  for (int q = 0; q < rank; ++q) off += counts[q];
  std::vector<float> out(counts[rank], 0.0f);
  for (const auto& buf : send) {
    for (int64_t i = 0; i < counts[rank]; ++i) out[i] += buf[off + i];
  }
  return out;
}

inline std::vector<float> RefAllGatherV(const Buffers& send) {
  std::vector<float> out;
  for (const auto& buf : send) out.insert(out.end(), buf.begin(), buf.end());
  return out;
}

// send_counts[i][j]: what rank i sends to rank j.
inline std::vector<float> RefAllToAllV(
    const Buffers& send, const std::vector<std::vector<int64_t>>& send_counts,
    int rank) {
  std::vector<float> out;
  for (size_t i = 0; i < send.size(); ++i) {
    int64_t off = 0;
    for (int j = 0; j < rank; ++j) off += send_counts[i][j];
    out.insert(out.end(), send[i].begin() + off,
               send[i].begin() + off + send_counts[i][rank]);
  }
  return out;
}

inline std::vector<float> RefAllReduce(const Buffers& data) {
  std::vector<float> out(data[0].size(), 0.0f);
  for (const auto& buf : data) {
    for (size_t i = 0; i < out.size(); ++i) out[i] += buf[i];
  }
  return out;
}

// Runs fn(rank) for every rank on its own thread and joins them all. The
// functions' waits are bounded by the communicators' timeouts.
inline void RunOnRanks(int size, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

}  // namespace canzona::testing

#endif  // CANZONA_TESTS_UNIT_COMM_COMM_TEST_UTIL_H_
