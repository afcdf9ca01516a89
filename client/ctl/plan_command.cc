#include "client/ctl/commands.h"

namespace canzona::ctl {

void AddPlanCommand(CLI::App& app) {
  app.add_subcommand("plan", "(not yet built)")->callback([] {
    throw CanzonactlExit(1, "plan: not yet built");
  });
}

}  // namespace canzona::ctl
