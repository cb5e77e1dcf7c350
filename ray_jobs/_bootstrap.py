"""Makes the project importable when a job runs as ``python ray_jobs/<job>.py`` (also under ray job submit),
and applies the local-Ray safe environment before anything imports ray."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import runtime.local_ray  # noqa: E402,F401  (sets the loopback-only environment on import)
