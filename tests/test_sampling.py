"""SamplingParams validation, on its own (no model)."""

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
    assert dataclasses.replace(params, n=3).width == 3


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
