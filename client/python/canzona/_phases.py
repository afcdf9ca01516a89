"""The optimizer step's named phases, as the daemon reports them.

The Python copy of the one list in proto/names/step_phases.h (``kStepPhases``), in
the order a step runs them, ``total`` (the whole step) last;
tests/python/check_phases.py fails when the two drift.
"""

STEP_PHASES = ("reduce_scatter", "world_reduce", "local_compute", "tp_gather",
               "tp_compute", "tp_scatter", "all_gather", "wait", "total")

# Reported beside the phases (PhaseTimes): the DP communication finished
# since the previous response, and the part of it the trainer waited for.
DP_COMM = ("dp_comm", "dp_comm_exposed")
