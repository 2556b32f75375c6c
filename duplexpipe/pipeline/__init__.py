"""Model to stages, the training API and launch helpers."""
