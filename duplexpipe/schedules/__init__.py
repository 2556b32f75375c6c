"""Schedules as pure data: IR, generators, lowering, verification and simulation (no torch.distributed)."""
