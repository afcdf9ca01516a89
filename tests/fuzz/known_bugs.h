// Known engine bugs: inputs that reach a reported, unfixed bug can be
// skipped, so that the fuzzer keeps looking for new problems while the bug
// awaits its fix. Every bug listed in known_bugs.cc is fixed now (layout and
// shape bounds, group names, Deregister coordinates, ns_steps <= 100), so
// skipping is off by default and the fuzzer checks the fixes;
// CANZONA_FUZZ_KNOWN_BUGS=0 turns it on (SetSkipKnownBugs).
//
// Thread-safety: SetSkipKnownBugs is called once, before the first input;
// the checks are pure.
#ifndef CANZONA_TESTS_FUZZ_KNOWN_BUGS_H_
#define CANZONA_TESTS_FUZZ_KNOWN_BUGS_H_

#include "canzona/v1/optimizer_service.pb.h"

namespace canzona::fuzz {

void SetSkipKnownBugs(bool on);

// Whether registering `r` (or, below, deregistering `r` from a job of
// `layout`) reaches a known bug; always false while skipping is off.
bool KnownEngineBug(const v1::RegisterRequest& r);
bool KnownEngineBug(const v1::DeregisterRequest& r,
                    const v1::WorldLayout& layout);

// Whether a step of the job `r` registers would spin; always false while
// skipping is off.
bool StepWouldSpin(const v1::RegisterRequest& r);

}  // namespace canzona::fuzz

#endif  // CANZONA_TESTS_FUZZ_KNOWN_BUGS_H_
