// canzonactl: the operator and user command line of Canzona.
//   canzonactl plan    --model qwen3-32b --dp 32 --tp 8 ...  (planner)
//   canzonactl replay  --optimizer muon --param P.npy ...    (offline)
//   canzonactl bench   kernels                               (kernel rates)
//   canzonactl bench   step --overlap --shard-group-size S   (step vs daemons)
//   canzonactl status  [--target ADDR]                       (a daemon's jobs)
//   canzonactl checkpoint save|load|inspect ...              (checkpoints)
//   canzonactl simulate --model ... --profile h100-node      (step on paper)
//   canzonactl calibrate --out this-machine.json             (this machine)
#include <cstdio>
#include <exception>

#include "CLI/CLI.hpp"
#include "client/ctl/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"canzonactl: inspect, plan, replay and benchmark Canzona"};
  app.require_subcommand(1);
  canzona::ctl::AddPlanCommand(app);
  canzona::ctl::AddReplayCommand(app);
  canzona::ctl::AddBenchCommand(app);
  canzona::ctl::AddStatusCommand(app);
  canzona::ctl::AddCheckpointCommand(app);
  canzona::ctl::AddSimulateCommand(app);
  canzona::ctl::AddCalibrateCommand(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // Usage errors: one line on stderr, status 2.
    std::fprintf(stderr, "canzonactl: %s\n", e.what());
    return 2;
  } catch (const canzona::ctl::CanzonactlExit& e) {
    if (e.what()[0] != '\0') std::fprintf(stderr, "canzonactl: %s\n", e.what());
    return e.code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "canzonactl: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
