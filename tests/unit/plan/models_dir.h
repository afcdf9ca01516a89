// The source tree's server/plan/models, compiled into the planner tests
// (CANZONA_PLAN_TEST_MODELS_DIR), for the tests that read real model configs.
#ifndef CANZONA_TESTS_UNIT_PLAN_MODELS_DIR_H_
#define CANZONA_TESTS_UNIT_PLAN_MODELS_DIR_H_

#include <string>

namespace canzona::plan {

inline std::string ModelsDir() { return CANZONA_PLAN_TEST_MODELS_DIR; }

}  // namespace canzona::plan

#endif  // CANZONA_TESTS_UNIT_PLAN_MODELS_DIR_H_
