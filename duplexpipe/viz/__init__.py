"""Drawing schedules and timelines: Gantt charts (with extra lanes), comparison figures, Chrome traces, text grids."""

from duplexpipe.viz.compare import plot_comparison, plot_measured_vs_simulated
from duplexpipe.viz.gantt import MemoryCurves, activation_bytes_curve, plot_timeline
from duplexpipe.viz.lanes import plot_timeline_lanes
from duplexpipe.viz.text import render_text
from duplexpipe.viz.trace import chrome_trace, to_chrome_trace

__all__ = [
    "MemoryCurves",
    "activation_bytes_curve",
    "chrome_trace",
    "plot_comparison",
    "plot_measured_vs_simulated",
    "plot_timeline",
    "plot_timeline_lanes",
    "render_text",
    "to_chrome_trace",
]
