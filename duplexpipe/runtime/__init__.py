"""The runtime: executes one rank's instruction list over torch.distributed."""
