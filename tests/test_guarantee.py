"""The typed guarantee: its printed form per kind, immutability and helpers; the Literal kinds of events."""

import dataclasses

import pytest

from specgen.events import FINISH_REASONS, TOKEN_KINDS, FinishEvent, Generation, TokenEvent
from specgen.guarantee import GUARANTEE_KINDS, Guarantee


@pytest.mark.parametrize(("guarantee", "printed"), [
    (Guarantee("exact"), "exact"),
    (Guarantee("greedy"), "greedy"),
    (Guarantee("approximate", "bfloat16 rounds a multi-token verify pass differently"),
     "approximate: bfloat16 rounds a multi-token verify pass differently"),
    (Guarantee.off("speculative=false"), "off: speculative=false"),
    (Guarantee("greedy", "on CUDA float32 with TF32 off"), "greedy: on CUDA float32 with TF32 off"),
])
def test_the_printed_form_is_kind_then_reason(guarantee, printed):
    assert str(guarantee) == printed and f"[{guarantee}]" == f"[{printed}]"
    kind, _, reason = printed.partition(": ")
    assert Guarantee(kind, reason) == guarantee  # the printed form names both fields, nothing else


def test_kinds_and_helpers():
    assert GUARANTEE_KINDS == ("exact", "greedy", "approximate", "off")
    assert [Guarantee(k).speculative for k in GUARANTEE_KINDS] == [True, True, True, False]
    assert [Guarantee(k).exact for k in GUARANTEE_KINDS] == [True, True, False, False]
    assert Guarantee("exact").unconditional and not Guarantee("exact", "on CUDA").unconditional
    assert not Guarantee.off("x").unconditional
    assert Guarantee("exact", "on CUDA").with_kind("greedy") == Guarantee("greedy", "on CUDA")


def test_a_guarantee_is_frozen_hashable_and_checked():
    guarantee = Guarantee("exact")
    with pytest.raises(dataclasses.FrozenInstanceError):
        guarantee.kind = "off"
    assert len({Guarantee("exact"), Guarantee("exact"), Guarantee.off("a")}) == 2
    assert Guarantee("exact") != "exact"  # a value, not a string: consumers read its fields
    with pytest.raises(ValueError, match="guarantee kind is one of"):
        Guarantee("exactish")


def test_event_kinds_are_literals():
    assert TOKEN_KINDS == ("accepted", "resampled", "bonus", "plain")
    assert FINISH_REASONS == ("eos", "length", "stop", "context", "dead_end")
    hints = {f.name: f.type for f in dataclasses.fields(TokenEvent)}
    assert hints["kind"] == "TokenKind"
    assert {f.name: f.type for f in dataclasses.fields(FinishEvent)}["finish_reason"] == "FinishReason"
    assert {f.name: f.type for f in dataclasses.fields(Generation)}["guarantee"] == "Guarantee"


def test_an_exact_claim_names_the_numerical_path_it_is_exact_against():
    claim = Guarantee("exact", against="torch_quant (int4 ...)")
    assert claim.label() == "exact vs torch_quant (int4 ...)" and str(claim) == "exact"
    assert claim.with_kind("greedy").label() == "greedy vs torch_quant (int4 ...)"
    assert claim == Guarantee("exact")  # the path is shown, not compared: consumers compare kinds and reasons
    for other in (Guarantee("approximate", "a gap", against="x"), Guarantee.off("speculative=false"), Guarantee("exact")):
        assert other.label() == str(other)


def test_every_pipeline_names_its_target_path():
    from conftest import tiny_pipeline

    assert tiny_pipeline("sampling.temperature=0.8").guarantee.label() == "exact vs torch (float32)"
    assert tiny_pipeline("speculative=false").guarantee.against == "torch (float32)"
    assert tiny_pipeline("backend=torch", "dtype=int8").guarantee.label().startswith("greedy vs torch_quant (int8 (torch ")
