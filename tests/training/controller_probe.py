"""A Ray Train controller callback for the tests: which heavy packages the controller's process imported by the end
of its run (this module imports none of them, so the controller loads it without changing the answer)."""

import json
import sys

from ray.train.v2._internal.execution.callback import ControllerCallback

HEAVY = ("torch", "sentence_transformers", "transformers", "deepspeed", "mlflow")


class ControllerModules(ControllerCallback):
    def __init__(self, path: str):
        self.path = path

    def after_controller_finish(self, result) -> None:
        with open(self.path, "w") as out:
            json.dump(sorted(name for name in HEAVY if name in sys.modules), out)
