"""A model -> parts: chain split, tracing split, Hugging Face adapters, stage modules and meta init."""

from duplexpipe.model.split import PartInfo, Partition, plan_partition, split_model
from duplexpipe.model.stages import reset_parameters, seeded_init, seeded_part
from duplexpipe.model.trace_split import GraphPart, split_module

__all__ = [
    "GraphPart", "PartInfo", "Partition", "plan_partition", "reset_parameters", "seeded_init", "seeded_part",
    "split_model", "split_module",
]
