"""Checkpoints: a pipeline saved and resumed through torch.distributed.checkpoint under the model's own names, the
folders checked against their manifest and read without running code, and Hugging Face directories written out."""

from duplexpipe.train.checkpoint.folder import read_checked_metadata, verify_checkpoint
from duplexpipe.train.checkpoint.hf_export import save_pretrained
from duplexpipe.train.checkpoint.names import FORMAT
from duplexpipe.train.checkpoint.pipeline import (
    Checkpointable,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    state_keys,
)
from duplexpipe.train.checkpoint.storage import read_metadata_file

__all__ = ["FORMAT", "Checkpointable", "load_checkpoint", "read_checked_metadata", "read_checkpoint",
           "read_metadata_file", "save_checkpoint",
           "save_pretrained", "state_keys", "verify_checkpoint"]
