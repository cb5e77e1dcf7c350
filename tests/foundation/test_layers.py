"""The package layers of pyproject.toml's [tool.importlinter] hold (what `make lint` checks), so a change that makes
a lower layer import a higher one, or two modules of a package import each other, fails here too."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_imports_between_packages_run_one_way_and_no_package_has_a_cycle():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout
