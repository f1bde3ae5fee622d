"""SamplingParams validation and the sampler's top-k / top-p filtering, on fixed logits (no model)."""

import dataclasses
import math

import pytest
import torch

from paged_attn.engine.sampling import SAMPLING_EPS, SamplingParams, sample

BAD_PARAMS = [
    dict(max_tokens=0), dict(max_tokens=1.5), dict(max_tokens=True), dict(max_tokens="8"),
    dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature=-1.0), dict(temperature="0.5"),
    dict(temperature=None), dict(temperature=True),
    dict(top_p=math.nan), dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-0.5), dict(top_p=True),
    dict(top_k=2.5), dict(top_k=-1), dict(top_k=True),
    dict(n=2.0), dict(n=0), dict(n=True), dict(beam_width=2.0), dict(beam_width=0), dict(n=2, beam_width=2),
    dict(seed=1.5), dict(seed=True), dict(seed="1"), dict(seed=2**64),
    dict(ignore_eos=1), dict(ignore_eos="yes"), dict(ignore_eos=None),
    dict(stop_token_ids=5), dict(stop_token_ids="12"), dict(stop_token_ids=[1, -1]), dict(stop_token_ids=[1.0]),
    dict(stop_token_ids=[True]),
]


@pytest.mark.parametrize("kwargs", BAD_PARAMS, ids=repr)
def test_bad_params_raise_value_error(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_params_are_immutable_and_replace_validates():
    params = SamplingParams(temperature=0.8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = -1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.n = 2.0
    assert params.temperature == 0.8
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(params, temperature=-1.0)
    assert dataclasses.replace(params, n=3).num_seqs == 3


def test_width_is_a_deprecated_alias_of_num_seqs():
    params = SamplingParams(beam_width=4)
    assert params.num_seqs == 4 and SamplingParams(n=3).num_seqs == 3
    with pytest.warns(DeprecationWarning, match="num_seqs"):
        assert params.width == 4


def test_stop_token_ids_become_a_tuple():
    assert SamplingParams().stop_token_ids == ()
    assert SamplingParams(stop_token_ids=[5, 7]).stop_token_ids == (5, 7)
    assert SamplingParams(stop_token_ids=(i for i in (2, 0))).stop_token_ids == (2, 0)
    assert hash(SamplingParams(stop_token_ids=[5])) == hash(SamplingParams(stop_token_ids=(5,)))


def test_temperatures_below_eps_are_greedy():
    assert SamplingParams().is_greedy and SamplingParams(temperature=SAMPLING_EPS / 2).is_greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).is_greedy
    assert not SamplingParams(temperature=1).is_greedy
    # The sampler itself takes the argmax for them rather than dividing by a temperature that rounds to 0.
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 0.0]])
    tokens = sample(logits, SamplingParams(temperature=1e-300), torch.Generator().manual_seed(0))
    assert tokens.tolist() == [1, 0]


# Draws per case. A token holding a share q of the probability the filters keep goes unseen with probability
# (1 - q)**DRAWS. Below, q >= 0.05 for every token that must be drawn and for every token that a filter keeping
# one token too many would add, so a wrong set passes with probability < 0.95**2000 < 1e-44 (and a filter keeping
# one too few is caught by a missing token, not by a crash). The generator is seeded: the test is deterministic.
DRAWS = 2000


def drawn(probs, **kwargs):
    """The set of tokens sample() draws in DRAWS draws from the distribution ``probs``."""
    logits = torch.tensor(probs).log().expand(DRAWS, -1)
    params = SamplingParams(temperature=1.0, **kwargs)
    return set(sample(logits, params, torch.Generator().manual_seed(1234)).tolist())


@pytest.mark.parametrize("probs, kwargs, expected", [
    ([0.5, 0.3, 0.15, 0.05], dict(top_p=1.0), {0, 1, 2, 3}),
    ([0.5, 0.3, 0.15, 0.05], dict(top_p=0.7), {0, 1}),
    ([0.5, 0.3, 0.15, 0.05], dict(top_p=0.5), {0}),  # 0.5 reaches 0.5: the second token is not needed
    ([0.5, 0.3, 0.15, 0.05], dict(top_p=0.95), {0, 1, 2}),  # 0.5 + 0.3 + 0.15 reaches 0.95
    ([0.5, 0.3, 0.15, 0.05], dict(top_p=0.96), {0, 1, 2, 3}),
    ([0.5, 0.3, 0.15, 0.05], dict(top_p=1e-9), {0}),  # the most likely token is always kept
    ([0.05, 0.15, 0.5, 0.3], dict(top_p=0.7), {2, 3}),  # order in the vocabulary does not matter
    ([0.5, 0.4, 0.1], dict(top_p=0.5), {0}),  # the first token's probability comes out 0.4999999948
    ([0.7, 0.2, 0.1], dict(top_p=0.9), {0, 1}),
    ([0.5, 0.25, 0.125, 0.125], dict(top_p=0.75), {0, 1}),  # binary fractions: exact boundaries
    ([0.5, 0.25, 0.125, 0.125], dict(top_p=0.875), {0, 1, 2}),
    ([0.5, 0.25, 0.125, 0.125], dict(top_p=0.8), {0, 1, 2}),
    ([0.5, 0.3, 0.15, 0.05], dict(top_k=2, top_p=0.95), {0, 1}),  # top-k cuts first
    ([0.5, 0.3, 0.15, 0.05], dict(top_k=3, top_p=0.7), {0, 1}),  # then top-p, on what top-k kept
    ([0.5, 0.3, 0.15, 0.05], dict(top_k=3, top_p=1.0), {0, 1, 2}),
    ([0.5, 0.3, 0.15, 0.05], dict(top_k=1), {0}),
])
def test_top_k_top_p_keep_the_smallest_set_reaching_p(probs, kwargs, expected):
    assert drawn(probs, **kwargs) == expected


def test_top_p_drawn_frequencies_follow_the_kept_renormalized_probabilities():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(20000, -1)
    tokens = sample(logits, SamplingParams(temperature=1.0, top_p=0.7), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=4).tolist()
    # 0.625 / 0.375 of 20000 draws; a standard deviation is 68 draws, the bound is 7 of them.
    assert abs(counts[0] - 12500) < 500 and counts[2] == counts[3] == 0
