"""``python -m worker_svc [--config worker.toml]``"""

from __future__ import annotations

import sys

from infermesh.service_main import service_main
from worker_svc import config
from worker_svc.service import main

if __name__ == "__main__":
    sys.exit(service_main("worker", config.load, main.serve, sys.argv[1:]))
