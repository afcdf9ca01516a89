// One OpenBLAS thread for every test of the binary that includes this: the
// engine tests compare bitwise across ranks and processes, and BLAS results
// must not depend on how many threads the machine offers (ctest's
// OPENBLAS_NUM_THREADS=1 does the same for discovered tests; a binary run
// by hand gets it here).
//
//   #include "tests/unit/engine/single_threaded_blas.h"   // that is all
//
// Thread-safety: registered once per binary, before main runs the tests.
#ifndef CANZONA_TESTS_UNIT_ENGINE_SINGLE_THREADED_BLAS_H_
#define CANZONA_TESTS_UNIT_ENGINE_SINGLE_THREADED_BLAS_H_

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace canzona::engine_test {

class SingleThreadedBlas : public ::testing::Environment {
 public:
  void SetUp() override { SetCpuBlasThreads(1); }
};

// Inline: one registration however many files of the binary include it.
inline const ::testing::Environment* const kSingleThreadedBlas =
    ::testing::AddGlobalTestEnvironment(new SingleThreadedBlas);

}  // namespace canzona::engine_test

#endif  // CANZONA_TESTS_UNIT_ENGINE_SINGLE_THREADED_BLAS_H_
