"""The EAGLE-3 attention head: training-time test computes exactly what decoding computes.

Training unrolls every start of a window at once (:meth:`Eagle3Head.ttt_logits`);
decoding runs context nodes against the session's draft KV cache and draft nodes
against their ancestors (:meth:`Eagle3Head.forward_nodes`). The two must agree
node for node, or the head would be trained for a different computation than
the one it drafts with.
"""

from __future__ import annotations

import pytest
import torch

from specgen.heads import HeadConfig, build_head

D, VOCAB = 16, 40


def _head(seed: int = 0):
    cfg = HeadConfig(kind="eagle3", hidden_size=D, draft_vocab_size=20, feature_layers=[1, 2, 3],
                     intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     rope_theta=100.0)
    gen = torch.Generator().manual_seed(seed)
    head = build_head(cfg, torch.arange(0, 40, 2))
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    head.attach(torch.randn(VOCAB, D, generator=gen), torch.randn(VOCAB, D, generator=gen))
    return head.eval()


def _window(seed: int, length: int, depth: int):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(1, length, 3 * D, generator=gen)  # [1, T, F]
    stream = torch.randint(0, VOCAB, (length + depth,), generator=gen)
    tokens = torch.stack([stream[k + 1: k + 1 + length] for k in range(depth)]).unsqueeze(1)  # [D, 1, T]
    return features, tokens


@torch.no_grad()
@pytest.mark.parametrize("start", [0, 3, 6])
def test_training_time_test_equals_decoding_a_chain(start):
    head = _head()
    length, depth = 7, 4
    features, tokens = _window(1, length, depth)
    trained = head.ttt_logits(features, tokens)  # [D, 1, T, Vd]
    states, logits, keys, values = head.forward_nodes(features[0], tokens[0, 0], torch.arange(length))
    torch.testing.assert_close(logits, trained[0, 0], atol=1e-5, rtol=1e-5)
    past_k, past_v, state = keys[: start + 1], values[: start + 1], states[start: start + 1]
    for step in range(1, depth):  # a chain of draft nodes below context node ``start``
        state, out, k, v = head.forward_nodes(state, tokens[step, 0, start: start + 1],
                                              torch.tensor([start + step]), past_k, past_v)
        torch.testing.assert_close(out[0], trained[step, 0, start], atol=1e-5, rtol=1e-5)
        past_k, past_v = torch.cat([past_k, k]), torch.cat([past_v, v])


@torch.no_grad()
def test_a_tree_level_sees_only_its_own_ancestors():
    """Siblings drafted in one batched step must not see each other: each equals its own chain."""
    head = _head(2)
    length = 5
    features, tokens = _window(3, length, 1)
    states, _, keys, values = head.forward_nodes(features[0], tokens[0, 0], torch.arange(length))
    root = states[-1:]
    level1 = torch.tensor([4, 9, 17])
    s1, _, k1, v1 = head.forward_nodes(root.expand(3, -1), level1, torch.full((3,), length), keys, values,
                                       torch.cat([torch.ones(3, length, dtype=torch.bool),
                                                  torch.eye(3, dtype=torch.bool)], dim=1))
    # level 2: children of the first and the third level-1 node, in one call
    rows, level2 = torch.tensor([0, 2]), torch.tensor([5, 5])
    ancestors = torch.zeros(2, 3, dtype=torch.bool)
    ancestors[0, 0] = ancestors[1, 2] = True
    allowed = torch.cat([torch.ones(2, length, dtype=torch.bool), ancestors, torch.eye(2, dtype=torch.bool)], dim=1)
    _, batched, _, _ = head.forward_nodes(s1[rows], level2, torch.full((2,), length + 1), torch.cat([keys, k1]),
                                          torch.cat([values, v1]), allowed)
    for i, row in enumerate(rows.tolist()):
        s, _, k, v = head.forward_nodes(root, level1[row: row + 1], torch.tensor([length]), keys, values)
        _, alone, _, _ = head.forward_nodes(s, level2[i: i + 1], torch.tensor([length + 1]), torch.cat([keys, k]),
                                            torch.cat([values, v]))
        torch.testing.assert_close(batched[i], alone[0], atol=1e-5, rtol=1e-5)
    # the negative control: letting siblings see each other changes the result
    _, leaky, _, _ = head.forward_nodes(s1[rows], level2, torch.full((2,), length + 1), torch.cat([keys, k1]),
                                        torch.cat([values, v1]), torch.ones_like(allowed))
    assert not torch.allclose(leaky, batched, atol=1e-3)


def test_an_attention_head_needs_a_valid_attention_shape():
    cfg = HeadConfig(kind="eagle3", hidden_size=D, draft_vocab_size=4, num_attention_heads=3, num_key_value_heads=2,
                     head_dim=8)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        build_head(cfg, torch.arange(4))
