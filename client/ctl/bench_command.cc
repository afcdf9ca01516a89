#include "client/ctl/commands.h"

namespace canzona::ctl {

void AddBenchCommand(CLI::App& app) {
  app.add_subcommand("bench", "(not yet built)")->callback([] {
    throw CanzonactlExit(1, "bench: not yet built");
  });
}

}  // namespace canzona::ctl
