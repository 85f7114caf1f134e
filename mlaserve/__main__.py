"""python -m mlaserve ... (same as the `mlaserve` console script)."""

from mlaserve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
