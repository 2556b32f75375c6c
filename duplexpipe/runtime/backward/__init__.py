"""The split backward: input gradients now (I, `stage_backward_input`), weight gradients later (W,
`stage_backward_weight`), on eager graphs, compiled regions and the layers that form their own weight gradients."""
