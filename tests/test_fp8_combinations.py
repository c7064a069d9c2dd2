"""fp8 training (``gmm(..., quantization="fp8" | "fp8_e5m2_grads")``) in the option space.

Hypothesis draws float32 m-grouped calls (`combinations.fp8_cases`): implementation (xla,
reference; the kernels' interpret mode with ``-m slow``) x recipe x transpose_rhs x bias x
activation (none, silu, gelu_tanh, gated swiglu) x a gated prologue (``lhs_activation``
swiglu or geglu, half the calls that do not gather lhs) x row operands (lhs_indices,
row_weights, out_indices) x group_offset x group sizes (an empty local group half the time, rows past
the total) on two shapes with K, N multiples of the 128 blocks. Each case is held to its
definition, the blockwise formula of tests/fp8_oracle.py fed the library's quantized
blocks (`combinations.fp8_expected`), forward and gradients:

* under jit (and eagerly, ``-m slow``);
* vmap over lhs, the weights, the group sizes, the row weights (any operand, ``-m
  slow``): each batch element its own formula, the gradient of the batch stacked or
  summed (batching only operands applied after the fp8 gmm leaves one gmm, whose
  backward quantizes the batch's summed cotangent);
* jvp: a TypeError naming the custom_vjp when the tangent reaches the fp8 gmm, the
  derivative along the row weights alone (applied after it);
* k-grouping and a transposed lhs: NotImplementedError saying what fp8 training covers.

The default run is deterministic: fixed cases and a few draws per property (each example
compiles a forward and a backward: seconds on one core); each ``*_slow`` twin draws SLOW
times as many.
"""

from __future__ import annotations

import combinations as comb
import hypothesis
import hypothesis.strategies as st
import pytest

SLOW = 10  # the slow twins draw this many times the default examples

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _settings(examples: int, slow: bool):
  return hypothesis.settings(max_examples=examples * (SLOW if slow else 1))


def _all_implementations():
  return comb.FP8_IMPLEMENTATIONS + tuple(
      name for name in comb.FP8_KERNELS if name in comb.available_implementations())


# --------------------------------------------------------------- the blockwise formula


# Fixed cases besides the few default draws (the first of which is the simplest case):
# the direct call (the user's cotangent reaches the fp8 gmm, nonzero on rows of no local
# group: group 0 is not held, rows past the total share the second 128-row block), and the
# MoE call (rows by index, gated activation, router weights, slots).
ORACLE_CASES = [
    pytest.param(comb.Case(quant="fp8_e5m2_grads", m=160, k=128, n=128, sizes=(30, 0, 100),
                           group_offset=1, num_local=2, bias=True, transpose_rhs=True),
                 id="direct-offset-empty-past_total"),
    pytest.param(comb.Case(implementation="reference", quant="fp8", m=40, k=256, n=128,
                           sizes=(12, 0, 20), num_local=3, activation="swiglu", bias=True,
                           rows=("lhs_indices", "row_weights", "out_indices"), out_rows=80),
                 id="moe-swiglu-rows"),
]


@pytest.mark.parametrize("case", ORACLE_CASES)
def test_fp8_case_equals_its_formula(case):
  comb.check_fp8_oracle(case)


@_settings(2, slow=False)
@hypothesis.given(case=comb.fp8_cases())
def test_fp8_equals_its_formula(case):
  comb.check_fp8_oracle(case)


@pytest.mark.slow
@_settings(3, slow=True)
@hypothesis.given(case=st.deferred(lambda: comb.fp8_cases(
    implementations=_all_implementations())), jit=st.booleans())
def test_fp8_equals_its_formula_slow(case, jit):
  comb.check_fp8_oracle(case, jit)


# ------------------------------------------------------- vmap = each element's formula


# The default run's vmap cases, one per operand the brief of this suite names (the lhs, the
# weights, the group sizes), each with options that change what the batch must carry:
# a derandomized draw of one example would be the simplest case (every group empty).
# The reference implementation compiles in half the time of xla's (whose vmaps the slow
# draws cover); the op's batching rule, not the implementation, batches.
_CASE = comb.Case(implementation="reference", quant="fp8", m=40, k=256, n=128,
                  sizes=(10, 0, 25), num_local=3)
VMAP_CASES = [
    pytest.param(_CASE.replace(quant="fp8_e5m2_grads",
                               activation="swiglu", bias=True, transpose_rhs=True,
                               rows=("lhs_indices", "row_weights")), "lhs", (), id="lhs"),
    pytest.param(_CASE.replace(m=160, k=128, sizes=(0, 150, 7), num_local=2,
                               group_offset=1, activation="silu", bias=True,
                               rows=("out_indices",), out_rows=320), "rhs", (), id="rhs"),
    # No activation or row operand: the user's cotangent reaches the fp8 gmm as given,
    # nonzero on the rows past each element's groups.
    pytest.param(_CASE.replace(bias=True), "group_sizes", ((10, 0, 25), (0, 33, 4)),
                 id="group_sizes"),
    # A gated prologue (the MoE down gmm reading z [M, 2K]) with the combine's rows.
    pytest.param(_CASE.replace(lhs_activation="swiglu", rows=("row_weights", "out_indices"),
                               out_rows=80), "lhs", (), id="lhs-prologue"),
    # Found by the slow draws: batching only the row weights leaves one fp8 gmm, whose
    # backward quantizes the batch's summed cotangent (not a loop of gradients).
    pytest.param(_CASE.replace(implementation="xla", activation="silu", sizes=(0, 3, 1),
                               group_offset=1, num_local=1,
                               rows=("lhs_indices", "row_weights", "out_indices"),
                               out_rows=40),
                 "row_weights", (), id="row_weights"),
]


@pytest.mark.parametrize("case, operand, batch", VMAP_CASES)
def test_fp8_vmap_is_each_elements_formula(case, operand, batch):
  comb.check_fp8_vmap(case, operand, batch)


@pytest.mark.slow
@_settings(4, slow=True)
@hypothesis.given(drawn=comb.vmap_cases(strategy=comb.fp8_cases()))
def test_fp8_vmap_is_each_elements_formula_slow(drawn):
  comb.check_fp8_vmap(*drawn)


# ------------------------------------------------------------------ jvp is refused


@st.composite
def _jvp_cases(draw):
  case = draw(comb.fp8_cases())
  names = comb.float_operands(case)
  chosen = tuple(name for name in names if draw(st.booleans()))
  return case, chosen or (draw(st.sampled_from(names)),)


@_settings(4, slow=False)
@hypothesis.given(drawn=_jvp_cases())
def test_fp8_jvp_is_refused_where_it_reaches_the_fp8_gmm(drawn):
  comb.check_fp8_jvp(*drawn)


# A tangent along the row weights alone never reaches the custom_vjp (a drawn run may not
# meet it); slow: it compiles a forward for a case the default run's other tests cover.
@pytest.mark.slow
def test_fp8_jvp_along_the_row_weights_alone():
  case = comb.Case(quant="fp8", m=40, k=256, n=128, sizes=(10, 0, 20), num_local=3,
                   activation="swiglu", rows=("row_weights", "out_indices"), out_rows=80)
  comb.check_fp8_jvp(case, ("row_weights",))


@pytest.mark.slow
@_settings(4, slow=True)
@hypothesis.given(drawn=_jvp_cases())
def test_fp8_jvp_is_refused_where_it_reaches_the_fp8_gmm_slow(drawn):
  comb.check_fp8_jvp(*drawn)


# ------------------------------------------- k-grouping and a transposed lhs are refused


@_settings(4, slow=False)
@hypothesis.given(case=comb.fp8_cases(refused=True))
def test_fp8_refuses_k_grouping_and_a_transposed_lhs(case):
  comb.check_fp8_refused(case)


@pytest.mark.slow
@_settings(4, slow=True)
@hypothesis.given(case=comb.fp8_cases(refused=True))
def test_fp8_refuses_k_grouping_and_a_transposed_lhs_slow(case):
  comb.check_fp8_refused(case)
