"""`python -m duplexpipe.cli`: the `duplexpipe` command."""

import sys

from duplexpipe.cli.main import main

sys.exit(main())
