"""duplexpipe: pipeline-parallel training for PyTorch with schedules as data."""

from duplexpipe.schedules.ir import Action, Op, Schedule, ScheduleError, StageInfo
from duplexpipe.schedules.timeline import Event, Timeline

__all__ = ["Action", "Event", "Op", "Schedule", "ScheduleError", "StageInfo", "Timeline"]
__version__ = "0.1.0"
