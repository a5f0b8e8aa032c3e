"""Pipeline parallelism over the `pipeline` mesh axis.

schedule.py: timetables (gpipe, 1f1b, interleaved_1f1b) the runner executes and the bench prints.
"""
from jaxpar.parallel.pipeline.schedule import (SCHEDULES, Timetable, build_timetable, check_schedule,
                                               idle_formula, plot_timetable)

__all__ = ["SCHEDULES", "Timetable", "build_timetable", "check_schedule", "idle_formula", "plot_timetable"]
