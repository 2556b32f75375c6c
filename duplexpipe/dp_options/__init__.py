"""The data-parallel settings the trainer accepts (gradient compression methods, ZeRO stages and the pairs it
refuses), torch-free: the trainer checks them and the planner enumerates them from the same table. Import each
name from its one home: `duplexpipe.dp_options.compression` (the compression options classes,
`compression_options`) or `duplexpipe.dp_options.zero` (`ZeroOptions`, the ZeRO rules)."""
