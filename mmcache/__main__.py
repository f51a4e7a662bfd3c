"""`python -m mmcache`: the same command line as the `mmcache` script."""

from __future__ import annotations

import sys

from mmcache.cli import main

if __name__ == "__main__":
    sys.exit(main())
