"""``python -m infermesh``: the developer commands of devtools."""

from __future__ import annotations

import sys

from devtools.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
