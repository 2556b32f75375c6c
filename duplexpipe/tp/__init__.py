"""Tensor parallelism: styles, plans checked and applied, the TP of a rank's stages, facts for the planner, the lane."""
