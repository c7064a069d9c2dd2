"""`nn.MoE`'s router and layer options in combination (tests/router_combinations.py): each
drawn case refused as documented or equal to the per-token oracle of tests/moe_oracle.py,
forward, gradients and aux, under nnx.jit, fused or not, partitionable or not; one
property with the tokens sharded over a 2 x 4 CPU mesh. Few examples of tiny shapes by
default; each ``*_slow`` twin (``-m slow``) draws many more (SLOW times its own count)."""

from __future__ import annotations

import pytest

pytest.importorskip("flax")

import hypothesis  # noqa: E402

import router_combinations as comb  # noqa: E402

SLOW = 10  # the slow twins draw this many times the default examples


def _settings(examples: int, slow: bool):
  return hypothesis.settings(max_examples=examples * (SLOW if slow else 1))


@_settings(30, slow=False)
@hypothesis.given(options=comb.router_cases().map(lambda case: case.kwargs))
def test_refusals_are_the_documented_ones(options):
  # Construction only (cheap): a combination is refused iff a documented rule says so,
  # with that rule's exception; the taken ones are computed by the tests below.
  comb.check_refusal(options)


@_settings(5, slow=False)
@hypothesis.given(case=comb.router_cases(taken=True))
@hypothesis.example(case=comb.EVERYTHING)
@hypothesis.example(case=comb.CAPACITY_PER_SEQUENCE)
def test_combination_equals_the_oracle(case):
  comb.check_case(case)


@pytest.mark.slow
@_settings(8, slow=True)
@hypothesis.given(case=comb.router_cases(taken=True))
def test_combination_equals_the_oracle_slow(case):
  comb.check_case(case)


@_settings(3, slow=False)
@hypothesis.given(case=comb.router_cases(sharded=True, taken=True))
@hypothesis.example(case=comb.SHARDED_SHARE)
def test_sharded_combination_equals_the_oracle(case):
  # Tokens over a 2 x 4 mesh under plain jit: the capacity per call is per token shard.
  comb.check_case(case)


@pytest.mark.slow
@_settings(3, slow=True)
@hypothesis.given(case=comb.router_cases(sharded=True, taken=True))
def test_sharded_combination_equals_the_oracle_slow(case):
  comb.check_case(case)
