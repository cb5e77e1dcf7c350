"""Heavy optional packages imported on first use, not when a library merely imports them for a rarely used path.

Every process that encodes text (each training worker, encoding actor and job driver) imports sentence-transformers,
and through it four packages it does not use here, about 4.4 s of CPU each time (measured on the machines that wrote
this; another 2-core machine pays up to 2x):

- bitsandbytes (~1.5 s): peft imports it whenever it is installed (peft is deferred too, see below), and it wraps
  its kernels in ``torch.compile`` at import, which loads TorchDynamo and Inductor. It stays a stand-in module
  (name, file and spec only, what ``inspect`` and pickling look at when they scan ``sys.modules``) until something
  uses it (a 4-bit QLoRA run, a submodule import); then the real package is imported and the stand-in forwards to
  it.
- scikit-learn (~2 s with the SciPy and pandas parts it loads): sentence-transformers' similarity module imports
  ``sklearn.metrics.pairwise_distances`` at import, for its Manhattan score of sparse embeddings. While
  that one module is imported, ``sklearn.metrics`` is a stand-in that hands out ``pairwise_distances`` as a function
  importing the real one on its first call; the stand-in is gone once the module is imported, so any other import of
  scikit-learn (k-means seeds of the ranked lists) is the real one, and so is the first call.
- peft (~0.55 s): transformers' trainer utilities take ``PeftModel`` and ``PeftMixedModel`` at import, only to ask
  ``isinstance`` of a model. While that module is imported they are stand-in classes: nothing is an instance of one
  until peft is really imported (no object can be a PeftModel before that), then they are the real classes.
- SciPy's optimizers (~0.35 s): transformers' object-detection loss takes ``linear_sum_assignment`` at import.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

DEFERRED = ("bitsandbytes",)
_DUNDERS_THAT_LOAD = ("__path__", "__version__", "__all__")


class DeferredModule(types.ModuleType):
    """A package's name in ``sys.modules`` until something uses it."""

    def __init__(self, spec):
        super().__init__(spec.name)
        self.__spec__, self.__file__, self.__loader__ = spec, spec.origin, spec.loader
        self.__package__ = spec.parent if spec.submodule_search_locations is None else spec.name
        self._real: types.ModuleType | None = None

    def _load(self) -> types.ModuleType:
        if self._real is None:
            if sys.modules.get(self.__name__) is self:
                del sys.modules[self.__name__]
            self._real = importlib.import_module(self.__name__)
        return self._real

    def __getattr__(self, attr: str):  # only for what the stand-in does not carry
        if attr.startswith("__") and attr.endswith("__") and attr not in _DUNDERS_THAT_LOAD:
            raise AttributeError(attr)  # probes such as __warningregistry__: a package that is not loaded has none
        return getattr(self._load(), attr)

    def __dir__(self):
        return dir(self._load())


def deferred_function(module: str, name: str):
    """``module.name`` as a function that imports ``module`` on its first call."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__module__ = module
    call.__doc__ = f"{module}.{name}, imported on its first call"
    return call


class _DeferredClassType(type):
    """The type of a class standing in for ``module.name``: nothing is an instance or subclass of it until
    ``module`` is really imported; any other use (a call, a class attribute) imports it and forwards."""

    def _real(cls) -> type:
        return getattr(importlib.import_module(cls._module), cls.__name__)

    def _imported(cls) -> bool:
        module = sys.modules.get(cls._module)
        return module is not None and not isinstance(module, (DeferredModule, _NamesOnUse))

    def __instancecheck__(cls, obj) -> bool:
        return cls._imported() and isinstance(obj, cls._real())

    def __subclasscheck__(cls, sub) -> bool:
        return cls._imported() and issubclass(sub, cls._real())

    def __call__(cls, *args, **kwargs):
        return cls._real()(*args, **kwargs)

    def __getattr__(cls, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return getattr(cls._real(), attr)


def deferred_class(module: str, name: str) -> type:
    """``module.name`` as a class for ``isinstance`` checks that imports ``module`` only on another use."""
    return _DeferredClassType(name, (), {"_module": module, "__module__": module,
                                         "__doc__": f"{module}.{name}, imported on its first use"})


# module being imported -> {module it imports: {name it takes from it at import: the stand-in's factory}}
DEFERRED_DURING = {
    "sentence_transformers.util.similarity": {"sklearn.metrics": {"pairwise_distances": deferred_function}},
    "transformers.trainer_utils": {"peft": {"PeftModel": deferred_class, "PeftMixedModel": deferred_class}},
    "transformers.trainer": {"peft": {"PeftModel": deferred_class}},
    # the object-detection losses transformers imports with every model (their Hungarian matching)
    **{f"transformers.loss.loss_{name}": {"scipy.optimize": {"linear_sum_assignment": deferred_function}}
       for name in ("for_object_detection", "rt_detr", "deformable_detr", "grounding_dino", "lw_detr", "rf_detr")},
}


class _NamesOnUse(types.ModuleType):
    """Stands in for ``module`` while another module is imported: the listed names come out as their stand-ins;
    anything else imports the real module."""

    def __init__(self, name: str, stand_ins: dict, spec):
        super().__init__(name)
        self._stand_ins = stand_ins
        self.__spec__ = spec  # what importlib.util.find_spec answers for a module in sys.modules (is it installed?)

    def __getattr__(self, attr: str):
        if attr in self._stand_ins:
            return self._stand_ins[attr](self.__name__, attr)
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)  # __path__ too: the import system asks it of every module it imports from
        sys.modules.pop(self.__name__, None)
        return getattr(importlib.import_module(self.__name__), attr)


@contextlib.contextmanager
def _stand_ins(imports: dict[str, dict]):
    placed = {}
    for name, stand_ins in imports.items():
        if name in sys.modules:
            continue
        if "." in name:  # a submodule's spec needs its package imported: only its name, then
            spec = importlib.machinery.ModuleSpec(name, None)
        elif (spec := importlib.machinery.PathFinder.find_spec(name)) is None:
            continue  # not installed: the import fails as it would without a stand-in
        placed[name] = sys.modules[name] = _NamesOnUse(name, stand_ins, spec)
    try:
        yield
    finally:
        for name, stand_in in placed.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]


class _LoaderWithStandIns(importlib.abc.Loader):
    def __init__(self, loader, imports: dict[str, dict]):
        self.loader, self.imports = loader, imports

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        with _stand_ins(self.imports):
            self.loader.exec_module(module)


class _DeferDuring(importlib.abc.MetaPathFinder):
    """Finds the modules of ``during`` as the path finder does, and imports them with their stand-ins."""

    def __init__(self, during: dict[str, dict[str, dict]]):
        self.during = during

    def find_spec(self, name, path, target=None):
        imports = self.during.get(name)
        if imports is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderWithStandIns(spec.loader, imports)
        return spec


def defer_optional_imports(names: tuple[str, ...] = DEFERRED,
                           during: dict[str, dict[str, dict]] = DEFERRED_DURING) -> None:
    """Stand-ins for each installed, not yet imported package in ``names``, and for the imports of the modules of
    ``during`` while they are imported (once per process: a second call with the same ``during`` adds nothing)."""
    for name in names:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is not None:
            sys.modules[name] = DeferredModule(spec)
    if during and not any(isinstance(f, _DeferDuring) and f.during is during for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferDuring(during))
