"""Schedule generators, one file per family: GPipe, 1F1B, interleaved 1F1B, zero bubble, DualPipe, the search (auto)."""
