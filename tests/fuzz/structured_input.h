// The structured fuzz input (InputKind::kStructured): bytes that a
// FuzzedDataProvider turns into whole jobs (layouts, groups and settings,
// parameters, buffer references into the fixture's shm objects), then
// steps with GradReady and WaitParams, plans, status and deregistrations, so
// that validation deeper than proto parsing and the registered paths
// (planning, setup, the step) are reached.
//
// Every choice has a valid default, taken when the provider's bytes run out
// (it then returns the smallest value, so choice 0 is always the default)
// and most of the time otherwise; mutations (a wrong value, arbitrary bytes)
// come with probability about 1/16 per choice. An empty payload is a valid
// DP1 x TP1 job that registers and steps. The seeds (make_seeds.cc) depend
// on the order in which choices consume bytes: keep it.
//
// Thread-safety: runs on libFuzzer's thread.
#ifndef CANZONA_TESTS_FUZZ_STRUCTURED_INPUT_H_
#define CANZONA_TESTS_FUZZ_STRUCTURED_INPUT_H_

#include <cstddef>
#include <cstdint>

namespace canzona::fuzz {

// Runs one structured input on a fresh daemon; a finding aborts.
void RunStructured(const uint8_t* data, size_t size);

}  // namespace canzona::fuzz

#endif  // CANZONA_TESTS_FUZZ_STRUCTURED_INPUT_H_
