"""Linen versions of the layers, from ``flax.nnx.bridge`` (not a second implementation)."""

from __future__ import annotations

from flax import nnx

from gmm_jax.nn.grouped_linear import GroupedLinear
from gmm_jax.nn.moe import MoE


def grouped_linear_linen(*args, name: str | None = None, **kwargs):
  """A Linen module wrapping `GroupedLinear` (``flax.nnx.bridge.ToLinen``); `name` names it
  in its parent (inside ``@linen.compact``)."""
  return nnx.bridge.ToLinen(GroupedLinear, args=args, kwargs=kwargs, name=name)


def moe_linen(*args, name: str | None = None, **kwargs):
  """A Linen module wrapping `MoE` (``flax.nnx.bridge.ToLinen``); `name` names it in its
  parent (inside ``@linen.compact``)."""
  return nnx.bridge.ToLinen(MoE, args=args, kwargs=kwargs, name=name)
