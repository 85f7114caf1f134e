"""python -m mlaserve ... (same as the `mlaserve` console script)."""

from mlaserve.cli import main

raise SystemExit(main())
