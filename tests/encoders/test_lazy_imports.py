"""Optional heavy packages load on first use: the import of sentence-transformers and a model build leave
bitsandbytes, scikit-learn, peft and SciPy's optimizers unloaded, and whatever uses them later gets the real thing
(encoders.lazy_imports)."""

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from encoders.lazy_imports import DeferredModule, defer_optional_imports, deferred_class, deferred_function

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
    (tmp_path / heavy / "metrics.py").write_text("CONST = 3\n\ndef score(x):\n    return x + CONST\n\n\n"
                                                 "class Model:\n    KIND = 'heavy'\n\n    def __init__(self, x):\n"
                                                 "        self.x = x\n")
    (tmp_path / f"{user}.py").write_text(f"from {heavy}.metrics import Model, score\n\n\n"
                                         "def is_model(obj):\n    return isinstance(obj, Model)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield heavy, user, marker
    for module in [m for m in sys.modules if m.startswith((heavy, user))]:
        del sys.modules[module]
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_DeferDuring" or heavy not in str(f.during)]


def test_a_function_taken_at_import_loads_its_module_on_the_first_call(packages):
    import importlib

    heavy, user, marker = packages
    defer_optional_imports(names=(), during={user: {f"{heavy}.metrics": {"score": deferred_function,
                                                                        "Model": deferred_class}}})
    module = importlib.import_module(user)
    assert not marker.exists() and f"{heavy}.metrics" not in sys.modules and heavy not in sys.modules
    assert not module.is_model(object()) and not issubclass(int, module.Model) and not marker.exists()
    assert module.score(1) == 4  # the first call imports the real module
    assert marker.read_text() == "ran\n"
    real = importlib.import_module(f"{heavy}.metrics")
    assert real.CONST == 3 and real.score(2) == 5 and sys.modules[f"{heavy}.metrics"] is real


def test_a_class_taken_at_import_has_no_instances_until_its_module_is_imported(packages):
    """isinstance of a stand-in class is False without importing anything (nothing can be an instance of a class
    that was never imported); once the module is imported, isinstance, subclass checks, calls and class attributes
    are the real class's."""
    import importlib

    heavy, user, marker = packages
    defer_optional_imports(names=(), during={user: {f"{heavy}.metrics": {"score": deferred_function,
                                                                        "Model": deferred_class}}})
    module = importlib.import_module(user)
    assert not module.is_model(3) and not marker.exists() and heavy not in sys.modules
    real = importlib.import_module(f"{heavy}.metrics").Model
    assert module.is_model(real(1)) and issubclass(real, module.Model) and not module.is_model(object())
    made = module.Model(5)  # a call builds the real class
    assert type(made) is real and made.x == 5 and module.Model.KIND == "heavy" and marker.read_text() == "ran\n"


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


def test_an_encoder_builds_without_the_deferred_packages_and_their_users_still_work():
    """In a new process, as a worker starts: importing sentence-transformers after encoders and building a model
    loads none of bitsandbytes, scikit-learn, peft and SciPy's optimizers (about 4 s of CPU here);
    sentence-transformers' Manhattan score of sparse embeddings (scikit-learn's pairwise_distances), a bitsandbytes
    attribute, transformers' check for a peft model and its Hungarian matching (SciPy) then work as if imported
    plainly."""
    code = (
        "import json, sys, torch\n"
        "import encoders, sentence_transformers\n"
        "from encoders.backbone import build_encoder\n"
        "from encoders.sources import resolve_model_source\n"
        "model = build_encoder(resolve_model_source('tiny:bert'))[0].auto_model\n"
        "loaded = {m: m in sys.modules and type(sys.modules[m]).__name__ == 'module' "
        "for m in ('sklearn', 'sklearn.metrics', 'bitsandbytes', 'peft', 'scipy.optimize')}\n"
        "from transformers.trainer_utils import _is_peft_model\n"
        "plain_is_peft = _is_peft_model(model)\n"
        "from sentence_transformers.util import manhattan_sim\n"
        "a, b = torch.tensor([[1.0, 2.0], [0.0, 1.0]]).to_sparse(), torch.tensor([[2.0, 0.0]]).to_sparse()\n"
        "import bitsandbytes as bnb\n"
        "import peft\n"
        "lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=['query']))\n"
        "from transformers.loss.loss_rt_detr import linear_sum_assignment\n"
        "print(json.dumps({'loaded': loaded, 'manhattan': manhattan_sim(a, b).tolist(),\n"
        "                  'sklearn_after': 'sklearn.metrics' in sys.modules,\n"
        "                  'linear4bit': bnb.nn.Linear4bit.__name__,\n"
        "                  'peft_model': [plain_is_peft, _is_peft_model(lora)],\n"
        "                  'matching': [a.tolist() for a in linear_sum_assignment([[2.0, 1.0], [1.0, 3.0]])]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["loaded"] == {"sklearn": False, "sklearn.metrics": False, "bitsandbytes": False, "peft": False,
                                "scipy.optimize": False}
    assert result["manhattan"] == [[-3.0], [-3.0]]  # -(|1-2| + |2-0|), -(|0-2| + |1-0|)
    assert result["sklearn_after"] and result["linear4bit"] == "Linear4bit"
    assert result["peft_model"] == [False, True]
    assert result["matching"] == [[0, 1], [1, 0]]  # the cheaper assignment: 1 + 1 rather than 2 + 3
