"""``python -m infermesh``: the developer commands of infermesh.cli."""

from __future__ import annotations

import sys

from infermesh.cli.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
