"""Python code shipped with a model folder (a custom architecture behind `auto_map`) runs only with
model.trust_remote_code: true; the export records the choice so loading the trained model asks for the same."""

import json

import pytest


def test_shipped_code_runs_only_when_trusted_and_the_export_remembers(shipped_code_model, tmp_path):
    from encoders.backbone import RAOE_META, build_encoder, export_encoder, inference_embeddings, load_encoder

    folder, marker = shipped_code_model("tiny:bert", "BertConfig", "BertModel")
    with pytest.raises(ValueError, match="trust_remote_code"):
        build_encoder(str(folder), pooling="mean")
    assert not marker.exists()  # refused before importing anything from the folder
    model = build_encoder(str(folder), pooling="mean", trust_remote_code=True)
    assert marker.read_text() == "ran" and type(model[0].auto_model).__name__ == "RaoeModel"
    exported = export_encoder(model, tmp_path / "export")
    assert json.loads((exported / RAOE_META).read_text())["trust_remote_code"] is True
    assert inference_embeddings(load_encoder(exported), ["a man plays music."]).shape[0] == 1
