"""``python -m router_svc [--config router.toml]``"""

from __future__ import annotations

import sys

from infermesh.service_main import service_main
from router_svc import config, server

if __name__ == "__main__":
    sys.exit(service_main("router", config.load, server.serve, sys.argv[1:]))
