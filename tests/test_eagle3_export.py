"""EAGLE-3 heads in the vLLM / SGLang layout (:mod:`specgen.heads.export`), both ways.

The expected names, shapes and config keys are the ones the engines' loaders read
(vLLM ``model_executor/models/llama_eagle3.py``, SGLang ``srt/models/llama_eagle3.py``;
see the module docstring of :mod:`specgen.heads.export`). No hub download: the tiny
target and a random head are built in code.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors import safe_open

from specgen.cli.main import main as specgen_main
from specgen.errors import ConfigError, ModelLoadError
from specgen.heads import HeadConfig, build_head, load_head, save_head, target_fingerprint
from specgen.heads.export import aux_layer_ids, export_eagle3, load_eagle3_dir
from specgen.models.causal_lm import select_features
from specgen.models.tiny import build_tiny_model

LAYERS, VOCAB, D, HEADS, KV, HD, INNER = 6, 16, 32, 4, 2, 8, 48
DRAFT_VOCAB = [0, 3, 4, 7, 9, 12, 15]
TINY_ARGS = ("target=tiny", f"target.source.num_layers={LAYERS}")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: more threads only contend (like the pipelines' threads=1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _target(seed: int = 0):
    return build_tiny_model(seed=seed, vocab_size=VOCAB, hidden_size=D, num_layers=LAYERS,
                            num_heads=4, num_kv_heads=2).eval()


def _head(target, feature_layers=(1, 3, 5), seed: int = 0):
    cfg = HeadConfig(kind="eagle3", hidden_size=D, draft_vocab_size=len(DRAFT_VOCAB),
                     feature_layers=list(feature_layers), intermediate_size=INNER, num_attention_heads=HEADS,
                     num_key_value_heads=KV, head_dim=HD, rope_theta=500.0, norm_eps=1e-5)
    gen = torch.Generator().manual_seed(seed)
    head = build_head(cfg, torch.tensor(DRAFT_VOCAB))
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    head.eval().requires_grad_(False)
    head.attach(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return head


@torch.no_grad()
def _draft_logits(head, target, ids=(1, 5, 2, 9, 4, 11, 3)):
    """Context nodes over a prompt, then one draft node: [N + 1, Vd] logits."""
    ids = torch.tensor([ids])
    hidden = target(ids, output_hidden_states=True).hidden_states
    feats = select_features(hidden, head.cfg.feature_layers)[0, :-1]  # [N, 3d]
    n = feats.shape[0]
    states, logits, k, v = head.forward_nodes(feats, ids[0, 1:], torch.arange(n))
    _, last, _, _ = head.forward_nodes(states[-1:], torch.tensor([6]), torch.tensor([n]), k, v)
    return torch.cat([logits, last])


def _export(head, target, out, **kwargs):
    return export_eagle3(head, out, target_config=target.config, fingerprint=target_fingerprint(target), **kwargs)


# What the engines' loaders read, for d = 32, H = 4, KV = 2, hd = 8, I = 48, Vd = 7, V = 16.
EXPECTED_TENSORS = {
    "fc.weight": ([D, 3 * D], torch.float32),
    "midlayer.input_layernorm.weight": ([D], torch.float32),
    "midlayer.hidden_norm.weight": ([D], torch.float32),
    "midlayer.self_attn.q_proj.weight": ([HEADS * HD, 2 * D], torch.float32),
    "midlayer.self_attn.k_proj.weight": ([KV * HD, 2 * D], torch.float32),
    "midlayer.self_attn.v_proj.weight": ([KV * HD, 2 * D], torch.float32),
    "midlayer.self_attn.o_proj.weight": ([D, HEADS * HD], torch.float32),
    "midlayer.post_attention_layernorm.weight": ([D], torch.float32),
    "midlayer.mlp.gate_proj.weight": ([INNER, D], torch.float32),
    "midlayer.mlp.up_proj.weight": ([INNER, D], torch.float32),
    "midlayer.mlp.down_proj.weight": ([D, INNER], torch.float32),
    "norm.weight": ([D], torch.float32),
    "lm_head.weight": ([len(DRAFT_VOCAB), D], torch.float32),
    "d2t": ([len(DRAFT_VOCAB)], torch.int64),
    "t2d": ([VOCAB], torch.bool),
}
EXPECTED_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D,
    "intermediate_size": INNER, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
    "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500.0,
    "vocab_size": VOCAB, "draft_vocab_size": len(DRAFT_VOCAB), "tie_word_embeddings": False,
    "torch_dtype": "float32", "max_position_embeddings": 512,
    "eagle_aux_hidden_state_layer_ids": [1, 3, 5],  # vLLM: captured before decoder layer i = HF hidden_states[i]
    "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 2, 4]},  # SGLang: +1
}


def test_names_shapes_dtypes_and_config_keys_match_the_engines(tmp_path):
    target = _target()
    out = _export(_head(target), target, tmp_path / "draft", dtype=torch.float32)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        got = {name: (list(f.get_tensor(name).shape), f.get_tensor(name).dtype) for name in f.keys()}
        meta = f.metadata()
    assert got == EXPECTED_TENSORS
    config = json.loads((out / "config.json").read_text())
    assert {k: config.get(k) for k in EXPECTED_CONFIG} == EXPECTED_CONFIG
    assert meta["format"] == "pt" and json.loads(meta["specgen.fingerprint"]) == target_fingerprint(target)


def test_bfloat16_export_stores_bfloat16_weights_and_integer_maps(tmp_path):
    target = _target()
    out = _export(_head(target), target, tmp_path / "draft")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}
    assert {dtypes.pop("d2t"), dtypes.pop("t2d")} == {torch.int64, torch.bool}
    assert set(dtypes.values()) == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_d2t_and_t2d_describe_the_draft_vocabulary(tmp_path):
    target = _target()
    head = _head(target)
    out = _export(head, target, tmp_path / "draft", dtype=torch.float32)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        d2t, t2d, lm = f.get_tensor("d2t"), f.get_tensor("t2d"), f.get_tensor("lm_head.weight")
    targets = torch.arange(len(DRAFT_VOCAB)) + d2t  # how both engines map a draft index to a target id
    assert targets.tolist() == DRAFT_VOCAB
    assert t2d.nonzero().flatten().tolist() == sorted(DRAFT_VOCAB)
    torch.testing.assert_close(lm, target.get_output_embeddings().weight[DRAFT_VOCAB], rtol=0, atol=0)


@pytest.mark.parametrize("layers", [(1, 3, 5), (5, 1, 3)])
def test_round_trip_gives_the_same_draft_logits(tmp_path, layers):
    target = _target()
    head = _head(target, layers)
    out = _export(head, target, tmp_path / "draft", dtype=torch.float32)
    back, meta = load_head(out, target, kind=("eagle", "eagle3"))  # through the drafter's own loader
    assert back.cfg.feature_layers == [1, 3, 5] and back.vocab_ids.tolist() == DRAFT_VOCAB
    expected, got = _draft_logits(head, target), _draft_logits(back, target)
    if layers == (1, 3, 5):
        assert torch.equal(got, expected)
    else:  # fc's column blocks were permuted into ascending layer order: same sums, another order
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert "specgen.fingerprint" in meta


def test_import_uses_the_files_own_lm_head_rows(tmp_path):
    target = _target()
    out = _export(_head(target), target, tmp_path / "draft", dtype=torch.float32)
    from safetensors.torch import load_file, save_file

    state = load_file(str(out / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * 2.0  # a head that trained its own LM head
    save_file(state, str(out / "model.safetensors"))  # also drops specgen's metadata: a foreign head
    head, meta = load_eagle3_dir(out, target)
    torch.testing.assert_close(head.lm_rows, 2.0 * target.get_output_embeddings().weight[DRAFT_VOCAB])
    assert "specgen.fingerprint" not in meta


def test_a_wrong_target_is_refused_with_one_line(tmp_path):
    target = _target()
    out = _export(_head(target), target, tmp_path / "draft", dtype=torch.float32)
    with pytest.raises(ModelLoadError, match="trained for a different target") as err:
        load_head(out, _target(seed=1), kind=("eagle", "eagle3"))
    assert "\n" not in str(err.value)


def test_a_foreign_head_of_another_shape_is_refused_with_one_line(tmp_path):
    target = _target()
    out = _export(_head(target), target, tmp_path / "draft", dtype=torch.float32)
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(out / "model.safetensors")), str(out / "model.safetensors"))  # no fingerprint
    other = build_tiny_model(seed=0, vocab_size=VOCAB, hidden_size=16, num_layers=LAYERS, num_heads=4,
                             num_kv_heads=2)
    with pytest.raises(ModelLoadError, match="hidden_size 32 and vocab_size 16.*has 16 and 16") as err:
        load_head(out, other)
    assert "\n" not in str(err.value)


def test_a_damaged_map_is_refused(tmp_path):
    target = _target()
    out = _export(_head(target), target, tmp_path / "draft", dtype=torch.float32)
    from safetensors.torch import load_file, save_file

    state = load_file(str(out / "model.safetensors"))
    state["t2d"][1] = True  # marks a target id d2t does not map to
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="t2d does not mark"):
        load_eagle3_dir(out, target)


def test_layer_ids_the_engines_cannot_capture_are_refused():
    assert aux_layer_ids([5, 1, 3], LAYERS) == ([1, 3, 5], [0, 2, 4])
    assert aux_layer_ids([-2, 1, 3], LAYERS) == ([1, 3, 5], [0, 2, 4])  # negative indices count from the end
    for bad in ([0, 2, 4], [1, 2], [1, 1, 3], [1, 3, LAYERS], [1, 3, -1]):  # embeddings, two, repeated, final norm
        with pytest.raises(ConfigError, match="exactly three distinct"):
            aux_layer_ids(bad, LAYERS)


def test_export_refuses_a_directory_with_other_files(tmp_path):
    target = _target()
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ConfigError, match="already holds other files"):
        _export(_head(target), target, tmp_path)


def _run_export(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["specgen", "export", *args])
    code = 0
    try:
        specgen_main()
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_specgen_export_writes_the_layout_and_the_serving_commands(tmp_path, monkeypatch, capsys):
    target = _target()
    head_file = save_head(tmp_path / "eagle3.safetensors", _head(target), target_fingerprint(target),
                          dtype=torch.float32)
    out = tmp_path / "eagle3-vllm"
    code, stdout, stderr = _run_export(monkeypatch, capsys, f"head={head_file}", f"out={out}", *TINY_ARGS)
    assert code == 0, stderr
    assert '"method": "eagle3"' in stdout and "--speculative-algorithm EAGLE3" in stdout and str(out) in stdout
    assert (out / "README.md").read_text() == stdout
    back, _ = load_head(out, target)
    torch.testing.assert_close(_draft_logits(back, target), _draft_logits(load_head(head_file, target)[0], target),
                               rtol=2e-2, atol=2e-2)  # bfloat16 file


@pytest.mark.parametrize("args, message", [
    (("head=missing.safetensors", "out=x"), "is not a file"),
    (("out=x",), "needs head="),
    (("head=a", "out=x", "prompt=hi"), "does not take prompt="),
    (("head=a", "out=x", "num_speculative_tokens=0"), "from 1 to 64"),
    (("head=a", "out=x", "num_speculative_tokens=65"), "from 1 to 64"),
    (("head=a", "out=x", "num_speculative_tokens=" + "9" * 400), "from 1 to 64"),
    (("head=a", "out=x", "num_speculative_tokens=\u00b2"), "from 1 to 64"),
])
def test_specgen_export_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").write_text("")
    code, stdout, stderr = _run_export(monkeypatch, capsys, *args, *TINY_ARGS)
    assert code == 2 and stdout == ""
    assert stderr.count("\n") == 1 and stderr.startswith("specgen export: error:") and message in stderr


def test_specgen_export_refuses_a_head_of_another_target(tmp_path, monkeypatch, capsys):
    other = _target(seed=1)
    head_file = save_head(tmp_path / "h.safetensors", _head(other), target_fingerprint(other), dtype=torch.float32)
    code, stdout, stderr = _run_export(monkeypatch, capsys, f"head={head_file}", f"out={tmp_path / 'o'}", *TINY_ARGS)
    assert code == 2 and stderr.count("\n") == 1 and "different target" in stderr
    assert not (tmp_path / "o").exists()



def test_drafter_eagle_runs_an_exported_directory_greedy_equal_to_plain(tmp_path):
    """``drafter=eagle drafter.head_file=DIR``: the directory drafts, and greedy output stays the target's."""
    import specgen
    from conftest import TINY

    target = _target()
    out = _export(_head(target), target, tmp_path / "draft", dtype=torch.float32)
    pipe = specgen.pipeline(*TINY, *TINY_ARGS[1:], "drafter=eagle", f"drafter.head_file={out}",
                            "sampling.temperature=0", progress=False)
    assert str(pipe.guarantee) == "greedy"
    spec = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=24, seed=0)
    plain = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=24, seed=0, speculative=False)
    assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0


def test_specgen_train_export_writes_the_directory_next_to_the_head(tmp_path, monkeypatch):
    """``train.export=eagle3``: a short tiny run writes <out>-eagle3/ that loads back for the target."""
    import io

    from specgen.train.cli import compose_train, run_train

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    overrides = ["target=tiny", "target.source.num_layers=8", "train.kind=eagle3", "train.export=eagle3",
                 "train.head.intermediate_size=48", "train.head.draft_vocab_size=12", "train.num_conversations=8",
                 "train.max_len=32", "train.eval_conversations=2", "train.batch_tokens=32", "train.steps=2",
                 "train.threads=1", "train.progress=false", "train.device=cpu", f"train.out={tmp_path / 'h.safetensors'}"]
    run = run_train(compose_train(overrides), command="test", out=io.StringIO())
    out = tmp_path / "h-eagle3"
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # the engines' default (2, L // 2, L - 3)
    target = build_tiny_model(seed=0, num_layers=8)
    back, _ = load_head(out, target)
    trained, _ = load_head(run.path, target)
    for name, value in trained.state_dict().items():  # both files hold the trained weights in bfloat16
        assert torch.equal(back.state_dict()[name], value), name
    torch.testing.assert_close(_draft_logits(back, target), _draft_logits(trained, target),
                               rtol=2e-2, atol=2e-2)  # the export's LM-head rows are bfloat16 too


@pytest.mark.parametrize("extra, message", [
    (("train.kind=eagle",), "exports eagle3 heads"),
    (("train.kind=eagle3", "train.head.feature_layers=[1,2]"), "three distinct feature layers"),
    (("train.kind=eagle3", "train.export=onnx"), "not a layout specgen writes"),
])
def test_specgen_train_export_is_checked_before_loading(tmp_path, extra, message):
    from specgen.train.cli import compose_train, run_train

    cfg = compose_train(["target=tiny", "train.export=eagle3", f"train.out={tmp_path / 'h.safetensors'}", *extra])
    with pytest.raises(ConfigError, match=message):
        run_train(cfg, command="test")
