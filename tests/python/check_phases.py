#!/usr/bin/env python3
"""Fails when a list of the step's phases drifts from proto/names/step_phases.h.

kStepPhases is the one list: C++ users include it; the Python package keeps
a copy (canzona/_phases.py) that must equal it; the step simulator's phases
(server/plan/sim) and the HTML report's colours (client/ctl/plan_report.cc)
must use its names, the simulator adding only its cross-group all-reduce.

    python3 tests/python/check_phases.py [--root DIR]
"""

import argparse
import os
import re
import sys


def read(root, path):
    with open(os.path.join(root, path), encoding="utf-8") as f:
        return f.read()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    root = parser.parse_args().root
    problems = []

    header = read(root, "proto/names/step_phases.h")
    entries = re.findall(
        r'\{"(\w+)",\s*&canzona::v1::PhaseTimes::(\w+),\s*'
        r'&PhaseSeconds::(\w+)\}', header)
    phases = [name for name, _, _ in entries]
    if not phases or phases[-1] != "total":
        problems.append("proto/names/step_phases.h: no kStepPhases ending in total")
    for name, accessor, value in entries:
        if name != accessor or name != value:
            problems.append("proto/names/step_phases.h: %s reads PhaseTimes::%s "
                            "and PhaseSeconds::%s" % (name, accessor, value))

    sys.path.insert(0, os.path.join(root, "client", "python"))
    from canzona._phases import STEP_PHASES  # pylint: disable=import-outside-toplevel
    if list(STEP_PHASES) != phases:
        problems.append("client/python/canzona/_phases.py: %s != %s"
                        % (list(STEP_PHASES), phases))

    # The simulator and the engine take PhaseSeconds and its list from
    # step_phases.h; neither may keep a list or a struct of its own.
    for path in ("server/plan/sim/step_simulator.cc",
                 "server/plan/sim/step_simulator.h",
                 "server/engine/phase_seconds.h"):
        text = read(root, path)
        if re.search(r'\{"\w+",\s*&PhaseSeconds::', text):
            problems.append("%s: lists phases by hand (use kStepPhases)" % path)
        if re.search(r'struct PhaseSeconds\b', text):
            problems.append("%s: a PhaseSeconds of its own (use "
                            "proto/names/step_phases.h)" % path)
    simulator_only = {"cross_all_reduce"}
    report = read(root, "client/ctl/plan_report.cc")
    colours = re.findall(r'\{"(\w+)", "#[0-9a-f]{6}"\}', report)
    if not colours:
        problems.append("client/ctl/plan_report.cc: no phase colours")
    for name in colours:
        if name not in phases and name not in simulator_only:
            problems.append("client/ctl/plan_report.cc: phase colour %s is "
                            "not in kStepPhases" % name)

    for problem in problems:
        print("check_phases: " + problem)
    if problems:
        return 1
    print("check_phases: %d phases, one list" % len(phases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
