"""Ready-made training tasks (a model and its data) for `duplexpipe train`."""
