#include "client/ctl/commands.h"

namespace canzona::ctl {

void AddReplayCommand(CLI::App& app) {
  app.add_subcommand("replay", "(not yet built)")->callback([] {
    throw CanzonactlExit(1, "replay: not yet built");
  });
}

}  // namespace canzona::ctl
