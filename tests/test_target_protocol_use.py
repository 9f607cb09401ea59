"""Consumers see a target only through :class:`specgen.models.target.Target` (grep-level).

No module of specgen outside ``specgen/models/`` names a backend class, branches on a
backend's name, or reaches into a backend's model (``.lm.model``, ``target.model``):
what one backend has beyond the protocol is a capability or an optional protocol
(:mod:`specgen.models.target`). Names are read from the code's tokens, so a docstring or
comment that mentions a class does not count; comparisons are read from each line with
its comment cut off. The scanner is checked on synthetic snippets first (a negative
control: it must flag each kind of violation, and pass look-alikes).
"""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "specgen"
MODELS = PACKAGE / "models"

#: The target backends' classes (each implements Target in specgen/models/).
BACKEND_CLASSES = frozenset({"CausalLM", "LlamaCppLM", "QuantizedLM", "LeanLlama", "TargetDefaults"})
BACKEND_NAMES = ("torch", "torch_quant", "llama_cpp")
_NAME = "|".join(BACKEND_NAMES)
#: A comparison with a backend's name: ``x.backend == ...``, ``backend in (...)``,
#: ``draft_backend(source) != ...``, or any ``== "llama_cpp"`` against a backend-name literal
#: whose other side names a backend.
COMPARISONS = (
    re.compile(r"\bbackend\b\s*(==|!=|\bnot\s+in\b|\bin\b)"),
    re.compile(r"backend\w*\s*\([^()]*\)\s*(==|!=|\bnot\s+in\b|\bin\b)"),
    re.compile(rf"backend\w*\b[^\n=!]*(==|!=)\s*[\"']({_NAME})[\"']"),
    re.compile(rf"[\"']({_NAME})[\"']\s*(==|!=)\s*[\w.]*backend\b"),
)
#: Reaching into a backend's model.
REACH = re.compile(r"\b(lm|target)\.model\b")


def violations(source: str) -> list[str]:
    """``line: what`` for each backend class named, backend-name comparison, or reach into a
    backend's model in ``source`` (Python text)."""
    found = []
    comments: dict[int, int] = {}  # line -> column where its comment starts
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and token.string in BACKEND_CLASSES:
            found.append(f"{token.start[0]}: names {token.string}")
        elif token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.start[1]
    for number, line in enumerate(source.splitlines(), 1):
        code = line[: comments.get(number, len(line))]
        if any(pattern.search(code) for pattern in COMPARISONS):
            found.append(f"{number}: compares with a backend's name: {code.strip()}")
        if REACH.search(code):
            found.append(f"{number}: reaches into a backend's model: {code.strip()}")
    return found


def test_the_scanner_flags_each_kind_of_violation():
    snippet = '''
from specgen.models import CausalLM
from specgen.models.llama_cpp import LlamaCppLM as Llama
def f(target, source, lm):
    if target.backend == "llama_cpp":
        pass
    if draft_backend(source) == "llama_cpp":
        pass
    if "torch" != target.backend:
        pass
    if target.backend in ("torch", "torch_quant"):
        pass
    return lm.model, isinstance(target, QuantizedLM), runtime.target.lm.model
def g(pipe):
    return pipe.target.model.config
'''
    found = violations(snippet)
    lines = sorted({int(entry.split(":")[0]) for entry in found})
    assert lines == [2, 3, 5, 7, 9, 11, 13, 15], found
    assert sum("names" in entry for entry in found) == 3, found  # CausalLM, LlamaCppLM, QuantizedLM
    assert sum("reaches" in entry for entry in found) == 2, found  # lines 13 and 15


def test_the_scanner_passes_look_alikes():
    snippet = '''
"""Runs on :class:`specgen.models.causal_lm.CausalLM` and LlamaCppLM (a docstring)."""
from transformers import AutoModelForCausalLM  # a transformers class, not a backend's
def f(target, name, spec, cfg):
    if name == "llama_cpp":  # a baseline's name, not the target's backend
        pass
    if "llama_cpp" in cfg:
        pass
    more = f" or {target.context_hint}" if target.context_hint else ""
    label = f"grammar.backend={spec.backend}"  # target.backend == "torch" in a comment
    return target.capabilities.batches, self.model.forward, describe(target)["backend"]
'''
    assert violations(snippet) == []


def test_no_module_outside_models_names_a_backend_or_branches_on_its_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if MODELS in path.parents:
            continue
        found += [f"{path.relative_to(PACKAGE.parent)}:{entry}" for entry in violations(path.read_text("utf-8"))]
    assert found == [], "\n".join(found)


def test_each_backend_serves_the_protocol_as_its_capabilities_declare():
    import pytest
    import torch

    from specgen.errors import ConfigError
    from specgen.models import CausalLM, build_tiny_model
    from specgen.models.llama_cpp import LlamaCppLM
    from specgen.models.quantized import QuantizedLM
    from specgen.models.target import BatchCache, HFBacked, Target, TargetDefaults, hf_model_of

    lm = CausalLM(build_tiny_model(seed=0), vocab_size=16)
    assert isinstance(lm, Target) and lm.capabilities.batches and isinstance(lm.new_batch(2), BatchCache)
    assert not isinstance(lm.new_cache(), BatchCache)  # the protocol check can fail
    assert lm.capabilities.trees and lm.capabilities.compile and lm.context_hint is None and not lm.is_compiled
    assert hf_model_of(lm) is lm.model and isinstance(lm, HFBacked)
    out = lm.forward_tree(lm.new_cache(), [1, 2], [3, 4], torch.eye(2, dtype=torch.bool), [1, 1], feature_layers=[])
    assert all(hasattr(out, name) for name in ("features", "chain_features", "logits", "all_logits"))  # TreeRows
    assert out.logits(0).shape == (1, 16) and out.all_logits().shape == (3, 16)  # [1, vocab], [n + 1, vocab]
    for backend in (LlamaCppLM, QuantizedLM):  # compile is the refusing default
        assert backend.enable_compile is TargetDefaults.enable_compile
        assert backend.new_batch is not TargetDefaults.new_batch and not hasattr(backend, "forward_batch")
        assert getattr(backend, "compiled", None) is None
    assert LlamaCppLM.forward_tree is TargetDefaults.forward_tree  # chains only
    assert getattr(LlamaCppLM, "hf_model", None) is None
    quant = QuantizedLM(build_tiny_model(seed=0), 16, kind="int8", head_kind="int8")  # trees and features
    assert QuantizedLM.forward_tree is not TargetDefaults.forward_tree and quant.capabilities.trees
    assert hf_model_of(quant) is None  # the float model is kept only where a loader asks (keep_model)
    out = quant.forward_tree(quant.new_cache(), [1, 2], [3, 4], torch.eye(2, dtype=torch.bool), [1, 1],
                             feature_layers=[])
    assert out.logits(0).shape == (1, 16) and out.all_logits().shape == (3, 16) and out.features.shape == (3, 32)
    assert isinstance(quant.new_batch(2), BatchCache) and quant.capabilities.batches
    assert LlamaCppLM.context_hint == "raise llama_cpp.context" and QuantizedLM.context_hint is None

    class Chains(TargetDefaults):
        backend = "llama_cpp"

    with pytest.raises(ConfigError, match="the llama_cpp backend serves no tree forwards"):
        Chains().forward_tree(None, [1], [2], torch.eye(1, dtype=torch.bool), [1])
    with pytest.raises(ConfigError, match="the llama_cpp backend has no compiled path"):
        Chains().enable_compile()
    with pytest.raises(ConfigError, match="the llama_cpp backend serves no batched forwards"):
        Chains().new_batch(2)
    assert hf_model_of(Chains()) is None and not Chains().is_compiled
