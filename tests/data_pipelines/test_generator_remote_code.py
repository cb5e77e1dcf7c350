"""Every model a data job loads (annotation teachers, SAN's masked LM and LLM rewriter, the list generator and its
seed encoder, the post-training teacher) runs Python shipped with its folder only when its config says
trust_remote_code: true; refused otherwise before any of that code is imported."""

import pytest


def refused_then_trusted(build, marker):
    with pytest.raises(ValueError, match="trust_remote_code"):
        build(False)
    assert not marker.exists()
    built = build(True)
    assert marker.read_text() == "ran"
    return built


def test_teacher(shipped_code_model):
    from data_pipelines.teachers import TeacherConfig, TeacherEncoder

    folder, marker = shipped_code_model("tiny:bert", "BertConfig", "BertModel")
    teacher = refused_then_trusted(lambda trust: TeacherEncoder(TeacherConfig(
        name="t", source=str(folder), trust_remote_code=trust)), marker)
    assert type(teacher.model[0].auto_model).__name__ == "RaoeModel"
    assert teacher.encode(["a man plays music.", "a dog runs."]).shape[0] == 2


def test_san_masked_lm(shipped_code_model, tmp_path):
    from data_pipelines.san import MaskFiller, SanConfig

    folder, marker = shipped_code_model("tiny:bert-mlm", "BertConfig", "BertForMaskedLM", "AutoModelForMaskedLM")
    filler = refused_then_trusted(lambda trust: MaskFiller(SanConfig(
        model=str(folder), iterations=1, trust_remote_code=trust), str(folder), tmp_path / "cache"), marker)
    assert type(filler.model).__name__ == "RaoeModel"
    assert len(filler.rewrite(["a man is playing the guitar on a stage."])) == 1


def test_san_llm_and_list_generator(shipped_code_model):
    from data_pipelines.ranked import ListGenerator
    from data_pipelines.san import LlmRewriter, SanConfig

    folder, marker = shipped_code_model("tiny:qwen2-lm", "Qwen2Config", "Qwen2ForCausalLM", "AutoModelForCausalLM")
    rewriter = refused_then_trusted(lambda trust: LlmRewriter(SanConfig(
        method="llm", model=str(folder), max_new_tokens=4, trust_remote_code=trust), str(folder)), marker)
    assert type(rewriter.model).__name__ == "RaoeModel"
    with pytest.raises(ValueError, match="trust_remote_code"):
        ListGenerator(str(folder), "{sentence}", steps=1, lam=0.5, max_new_tokens=4)
    generator = ListGenerator(str(folder), "{sentence}", steps=1, lam=0.5, max_new_tokens=4, trust_remote_code=True)
    assert type(generator.model).__name__ == "RaoeModel"
    lists, _ = generator.generate(["a man plays music."])
    assert lists[0][0] == "a man plays music."


@pytest.mark.parametrize("model_trusts, teacher_trusts, expected", [
    (False, None, False), (True, None, True), (True, False, False), (False, True, True)])
def test_posttrain_teacher_follows_the_model_unless_set(model_trusts, teacher_trusts, expected):
    from jobconfig.schema import PosttrainJobConfig
    from training.kinds.lists import teacher_trusts_code

    cfg = PosttrainJobConfig(model={"trust_remote_code": model_trusts},
                             posttrain={"teacher_trust_remote_code": teacher_trusts})
    assert teacher_trusts_code(cfg) is expected
