"""Processes (run, launch, torchrun), the `duplexpipe train` loop and its config, metrics, bundled tasks.

Nothing is re-exported here: `launch.train_config` must import without torch (the command line parses
`duplexpipe train` with it); the public names are in `duplexpipe` itself.
"""
