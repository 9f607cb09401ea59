"""The GPU path checked on the CPU (issue 14): training targets, head fingerprints
across dtypes, heads in their own dtype, device and dtype resolution, and the
declared guarantee. Everything runs on tiny models built in code."""

from __future__ import annotations

import pytest
import torch

from specgen.heads import HeadConfig, build_head
from specgen.models.tiny import build_tiny_model
from specgen.train.data import random_corpus
from specgen.train.extract import extract_features
from specgen.train.loop import batch_targets, draft_lookup

VOCAB = 64


# ---- item 1: training targets are normalised ------------------------------------------------------------------

@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("store_dtype", [torch.bfloat16, torch.float16])
def test_training_targets_sum_to_one(model_dtype, store_dtype):
    """p over the full vocabulary, as training computes it, sums to 1 within 1e-5."""
    model = build_tiny_model(seed=3, vocab_size=VOCAB, init_scale=2.0).to(model_dtype)
    corpus = random_corpus(VOCAB, held_out=False, limit=3, max_len=24, seed=0)
    feats = extract_features(model, corpus.sequences, [], VOCAB, store_dtype=store_dtype)
    d = model.config.hidden_size
    head = build_head(HeadConfig(kind="medusa", hidden_size=d, draft_vocab_size=VOCAB, num_heads=2),
                      torch.arange(VOCAB)).float()
    head.attach(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    depth = 2
    _, _, p, _ = batch_targets(head, feats, draft_lookup(torch.arange(VOCAB), VOCAB), feats.starts(depth), depth,
                               torch.device("cpu"))  # p: [depth, B, VOCAB]
    worst = float((p.double().sum(-1) - 1.0).abs().max())
    assert worst < 1e-5, f"sum of p is off by {worst}"


# ---- item 2: the head fingerprint is robust across dtypes, and still refuses another target ------------------

def _fingerprints(model, dtypes=(torch.float32, torch.bfloat16, torch.float16)):
    import copy

    from specgen.heads import target_fingerprint

    return {dtype: target_fingerprint(copy.deepcopy(model).to(dtype)) for dtype in dtypes}


def test_fingerprint_accepts_every_dtype_of_the_same_weights():
    from specgen.heads.fingerprint import fingerprint_mismatch

    model = build_tiny_model(seed=0, init_scale=0.01)  # small weights: float16 rounds some of them to subnormals
    prints = _fingerprints(model)
    for trained, expected in prints.items():
        for loaded, actual in prints.items():
            assert fingerprint_mismatch(expected, actual) == [], (trained, loaded)
    # the v1 hash alone refused these (the bug this replaces)
    assert prints[torch.float16]["weights_sha256"] != prints[torch.bfloat16]["weights_sha256"]


def test_fingerprint_refuses_another_target():
    from specgen.heads import target_fingerprint
    from specgen.heads.fingerprint import fingerprint_mismatch

    model = build_tiny_model(seed=0)
    expected = target_fingerprint(model)
    other = target_fingerprint(build_tiny_model(seed=1))
    assert fingerprint_mismatch(expected, other) == ["weights_probe"]
    tuned = build_tiny_model(seed=0)
    with torch.no_grad():
        tuned.model.layers[1].mlp.down_proj.weight.mul_(1.03)  # one tensor fine-tuned by 3 %
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert fingerprint_mismatch(expected, target_fingerprint(tuned.to(dtype))) == ["weights_probe"]
    wider = target_fingerprint(build_tiny_model(seed=0, vocab_size=17))
    assert "vocab_size" in fingerprint_mismatch(expected, wider)


def test_v1_fingerprints_still_load_and_float16_reads_the_source(tmp_path):
    """Heads written before the probe (the shipped ones) carry only weights_sha256."""
    from transformers import AutoModelForCausalLM

    from specgen.heads import target_fingerprint
    from specgen.heads.fingerprint import fingerprint_mismatch

    build_tiny_model(seed=0, init_scale=0.01).save_pretrained(tmp_path / "src")
    loads = {dtype: AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=dtype)
             for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    v1 = {k: v for k, v in target_fingerprint(loads[torch.float32]).items()
          if k not in ("weights_probe", "shapes_sha256")}
    for dtype, model in loads.items():
        assert fingerprint_mismatch(v1, target_fingerprint(model), model) == [], dtype
    assert fingerprint_mismatch(v1, target_fingerprint(loads[torch.float16])) == ["weights_sha256"]
    other = build_tiny_model(seed=1, init_scale=0.01)
    assert fingerprint_mismatch(v1, target_fingerprint(other), other) == ["weights_sha256"]


# ---- item 3 (and issue 9 item 3): learned heads in reduced precision, drafters in their own dtype ------------

def _head_file(tmp_path, kind: str, feature_layers=()):
    import specgen
    from conftest import TINY
    from specgen.heads import save_head, target_fingerprint

    model = specgen.pipeline(*TINY, "drafter=none", progress=False).target.model
    d = model.config.hidden_size
    cfg = HeadConfig(kind=kind, hidden_size=d, draft_vocab_size=12, intermediate_size=2 * d, num_heads=4,
                     feature_layers=list(feature_layers))
    torch.manual_seed(0)
    head = build_head(cfg, torch.arange(12))
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.3)
    path = tmp_path / f"{kind}{len(feature_layers)}.safetensors"
    return save_head(path, head, target_fingerprint(model), dtype=torch.float32)


@pytest.mark.parametrize("kind,layers", [("eagle", ()), ("eagle", (1, 2)), ("medusa", ()), ("mtp", ()),
                                         ("mtp", (0, 2))])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_learned_heads_run_on_a_reduced_precision_target(tmp_path, kind, layers, dtype):
    """The float32 target feature meets a head in the target's dtype (the crash of issue 14 item 3)."""
    import specgen
    from conftest import TINY

    head = _head_file(tmp_path, kind, layers)
    for temperature in ("0", "0.8"):
        pipe = specgen.pipeline(*TINY, f"dtype={dtype}", f"drafter={kind}", f"drafter.head_file={head}",
                                "drafter.num_tokens=3", f"sampling.temperature={temperature}", progress=False)
        assert pipe.guarantee.kind == "approximate"
        assert next(pipe.drafter.head.parameters()).dtype == getattr(torch, dtype)
        drafted = 0
        for seed, prompt in enumerate(([1, 2, 3], [5, 4, 7, 1], [9, 9])):
            drafted += pipe.generate(prompt_ids=prompt, max_new_tokens=12, seed=seed).stats.drafted
        assert drafted > 0


@pytest.mark.parametrize("kind", ["eagle", "medusa", "mtp", "tiny"])
def test_drafter_in_its_own_dtype_keeps_the_guarantee(tmp_path, kind):
    """drafter.dtype=bfloat16 on a float32 target: the guarantee stays and greedy equals plain."""
    import specgen
    from conftest import TINY

    head = () if kind == "tiny" else (f"drafter.head_file={_head_file(tmp_path, kind)}",)
    pipe = specgen.pipeline(*TINY, f"drafter={kind}", *head, "drafter.dtype=bfloat16", "drafter.num_tokens=3",
                            "sampling.temperature=0", "sampling.repetition_penalty=1.3", progress=False)
    assert str(pipe.guarantee) == "greedy"
    drafter = pipe.drafter
    params = drafter.lm.model.parameters() if kind == "tiny" else drafter.head.parameters()
    assert next(params).dtype == torch.bfloat16
    assert next(pipe.target.model.parameters()).dtype == torch.float32
    for prompt in ([1, 2, 3], [5, 4, 7, 1]):
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=30, seed=0)
        assert spec.stats.drafted > 0
        assert spec.token_ids == pipe.generate(prompt_ids=prompt, max_new_tokens=30, speculative=False).token_ids


def test_drafter_dtype_is_validated():
    import specgen
    from conftest import TINY
    from specgen.errors import ConfigError

    with pytest.raises(ConfigError, match="drafter.dtype='float8'"):
        specgen.pipeline(*TINY, "drafter=tiny", "drafter.dtype=float8", progress=False)


@pytest.mark.parametrize("native", [True, False])
def test_drafter_dtype_auto_drafts_in_bfloat16_where_the_cpu_computes_it(monkeypatch, native):
    import torch

    from specgen import models

    assert isinstance(models.native_cpu_bfloat16(), bool)  # reads this machine's flags
    monkeypatch.setattr(models, "native_cpu_bfloat16", lambda: native)
    cpu = torch.device("cpu")
    assert models.resolve_drafter_dtype("auto", torch.float32, cpu) == (torch.bfloat16 if native else torch.float32)
    assert models.resolve_drafter_dtype(None, torch.float32, cpu) == torch.float32  # null: the target's
    assert models.resolve_drafter_dtype("float32", torch.bfloat16, cpu) == torch.float32


# ---- items 4 and 8: CUDA device index and dtype=auto (CUDA faked on the CPU) ----------------------------------

class _FakeCuda:
    def __init__(self, monkeypatch, count: int, native_bf16: bool):
        import contextlib

        self.entered: list = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "device", lambda d: self.entered.append(d) or contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True: native_bf16 or including_emulation)


def test_cuda_index_past_the_device_count_is_a_config_error(monkeypatch):
    from specgen.errors import ConfigError
    from specgen.models import resolve_device

    _FakeCuda(monkeypatch, count=2, native_bf16=True)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match=r"device=cuda:2 but only 2 CUDA devices are visible \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("native,expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_dtype_needs_native_bfloat16(monkeypatch, native, expected):
    from specgen.models import resolve_dtype

    fake = _FakeCuda(monkeypatch, count=2, native_bf16=native)
    assert resolve_dtype("auto", torch.device("cuda:1")) == expected
    assert fake.entered == [torch.device("cuda:1")], "the named device is the one asked"
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


# ---- item 7: the guarantee on CUDA names its condition and sets it --------------------------------------------

def test_cuda_float32_guarantee_turns_tf32_off_and_says_so():
    from specgen.guarantee import Guarantee
    from specgen.models import cuda_condition

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        cuda, cpu = torch.device("cuda:0"), torch.device("cpu")
        assert cuda_condition(Guarantee("greedy"), cpu, torch.float32) == Guarantee("greedy")
        approximate = Guarantee("approximate", "bfloat16 ...")
        assert cuda_condition(approximate, cuda, torch.bfloat16) == approximate
        assert torch.backends.cuda.matmul.allow_tf32, "nothing changes off CUDA float32"
        declared = str(cuda_condition(Guarantee("exact"), cuda, torch.float32))
        assert declared.startswith("exact: on CUDA float32 with TF32 off") and "scripts/gpu_check.sh" in declared
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
