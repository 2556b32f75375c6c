"""`make bench`: every benchmark part through the one runner (`python -m benchmarks --help`)."""

from benchmarks.runner import main

raise SystemExit(main())
