"""Optional heavy packages load on first use: the import of sentence-transformers leaves bitsandbytes and scikit-learn
unloaded, and whatever uses them later gets the real thing (encoders.lazy_imports)."""

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from encoders.lazy_imports import DeferredModule, defer_optional_imports

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """Two fresh packages on sys.path: ``heavy_<n>`` (its __init__ records that it ran; a submodule ``metrics`` with a
    function and a constant) and ``user_<n>``, which imports the function at import time."""
    name = tmp_path.name.replace("-", "_")
    heavy, user = f"heavy_{name}", f"user_{name}"
    marker = tmp_path / "heavy_ran"
    (tmp_path / heavy).mkdir()
    (tmp_path / heavy / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\nSIZE = 7\n")
    (tmp_path / heavy / "metrics.py").write_text("CONST = 3\n\ndef score(x):\n    return x + CONST\n")
    (tmp_path / f"{user}.py").write_text(f"from {heavy}.metrics import score\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield heavy, user, marker
    for module in [m for m in sys.modules if m.startswith((heavy, user))]:
        del sys.modules[module]
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_DeferDuring" or heavy not in str(f.during)]


def test_a_function_taken_at_import_loads_its_module_on_the_first_call(packages):
    import importlib

    heavy, user, marker = packages
    defer_optional_imports(names=(), during={user: {f"{heavy}.metrics": ("score",)}})
    module = importlib.import_module(user)
    assert not marker.exists() and f"{heavy}.metrics" not in sys.modules and heavy not in sys.modules
    assert module.score(1) == 4  # the first call imports the real module
    assert marker.read_text() == "ran\n"
    real = importlib.import_module(f"{heavy}.metrics")
    assert real.CONST == 3 and real.score(2) == 5 and sys.modules[f"{heavy}.metrics"] is real


def test_a_deferred_package_loads_once_when_used_and_not_when_scanned(packages):
    import importlib

    heavy, _, marker = packages
    defer_optional_imports(names=(heavy,), during={})
    stand_in = importlib.import_module(heavy)
    assert isinstance(stand_in, DeferredModule) and not marker.exists()
    inspect.getmodule(test_a_deferred_package_loads_once_when_used_and_not_when_scanned)  # scans every module's __file__
    assert not hasattr(stand_in, "__warningregistry__") and not marker.exists()
    assert stand_in.SIZE == 7 and marker.read_text() == "ran\n"
    metrics = importlib.import_module(f"{heavy}.metrics")  # a submodule of the real package
    assert metrics.score(0) == 3 and importlib.import_module(heavy).SIZE == 7 and marker.read_text() == "ran\n"


def test_sentence_transformers_imports_without_bitsandbytes_or_scikit_learn_and_their_users_still_work():
    """In a new process, as a worker starts: importing sentence-transformers after encoders loads neither package
    (about 3 s of CPU here); sentence-transformers' Manhattan score of sparse embeddings (scikit-learn's
    pairwise_distances) and a bitsandbytes attribute then work as if imported plainly."""
    code = (
        "import json, sys, torch\n"
        "import encoders, sentence_transformers\n"
        "loaded = {m: m in sys.modules and type(sys.modules[m]).__name__ == 'module' "
        "for m in ('sklearn', 'sklearn.metrics', 'bitsandbytes')}\n"
        "from sentence_transformers.util import manhattan_sim\n"
        "a, b = torch.tensor([[1.0, 2.0], [0.0, 1.0]]).to_sparse(), torch.tensor([[2.0, 0.0]]).to_sparse()\n"
        "import bitsandbytes as bnb\n"
        "print(json.dumps({'loaded': loaded, 'manhattan': manhattan_sim(a, b).tolist(),\n"
        "                  'sklearn_after': 'sklearn.metrics' in sys.modules,\n"
        "                  'linear4bit': bnb.nn.Linear4bit.__name__}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["loaded"] == {"sklearn": False, "sklearn.metrics": False, "bitsandbytes": False}
    assert result["manhattan"] == [[-3.0], [-3.0]]  # -(|1-2| + |2-0|), -(|0-2| + |1-0|)
    assert result["sklearn_after"] and result["linear4bit"] == "Linear4bit"
