"""Python code shipped with a model folder (a custom architecture behind `auto_map`) runs only with
model.trust_remote_code: true; the export records the choice so loading the trained model asks for the same."""

import json
import shutil

import pytest

CONFIG_CODE = '''import os, pathlib
from transformers import BertConfig
pathlib.Path(os.environ["RAOE_REMOTE_MARKER"]).write_text("ran")


class RaoeConfig(BertConfig):
    model_type = "raoe-custom"
'''
MODEL_CODE = '''from transformers import BertModel
from .configuration_raoe import RaoeConfig


class RaoeModel(BertModel):
    config_class = RaoeConfig
'''


@pytest.fixture
def custom_model(tmp_path, monkeypatch):
    from encoders.sources import resolve_model_source

    folder = tmp_path / "custom"
    shutil.copytree(resolve_model_source("tiny:bert"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="raoe-custom", architectures=["RaoeModel"],
                  auto_map={"AutoConfig": "configuration_raoe.RaoeConfig", "AutoModel": "modeling_raoe.RaoeModel"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_raoe.py").write_text(CONFIG_CODE)
    (folder / "modeling_raoe.py").write_text(MODEL_CODE)
    marker = tmp_path / "marker"
    monkeypatch.setenv("RAOE_REMOTE_MARKER", str(marker))
    return folder, marker


def test_shipped_code_runs_only_when_trusted_and_the_export_remembers(custom_model, tmp_path):
    from encoders.backbone import RAOE_META, build_encoder, encode_texts, export_encoder, load_encoder

    folder, marker = custom_model
    with pytest.raises(ValueError, match="trust_remote_code"):
        build_encoder(str(folder), pooling="mean")
    assert not marker.exists()  # refused before importing anything from the folder
    model = build_encoder(str(folder), pooling="mean", trust_remote_code=True)
    assert marker.read_text() == "ran" and type(model[0].auto_model).__name__ == "RaoeModel"
    exported = export_encoder(model, tmp_path / "export")
    assert json.loads((exported / RAOE_META).read_text())["trust_remote_code"] is True
    assert encode_texts(load_encoder(exported), ["a man plays music."]).shape[0] == 1
