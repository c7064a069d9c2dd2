"""Flax (nnx) layers on gmm: `GroupedLinear` and a routed mixture-of-experts block `MoE`.

Needs the optional extra: ``pip install "gmm_jax[flax]"``. Linen versions come from
``flax.nnx.bridge`` (`grouped_linear_linen`, `moe_linen`), not a second implementation.

Parameters carry logical axis names ("expert", "embed", "mlp") as variable metadata, so
users shard them with their own rules (``nnx.get_partition_spec`` + a logical-to-mesh map);
under ``jax.set_mesh`` the names that are axes of the mesh (after ``nnx.logical_axis_rules``)
shard the parameters as they are created, as nnx.Linear does.

The modules, by what they do: `router` (scores, top-k, expert groups, the routing bias, the
auxiliary losses: `Router`, replaceable), `expert_ffn` (the routed experts' FFN variants),
`shared` (the shared experts), `dispatch` (which of the routed-expert strategies a call
runs), `config` (`MoEConfig`, the layer's options, checked), `presets` (a `MoEConfig` per
public model), `moe` (`MoE`, composing them), `grouped_linear` and `linen`.
"""

from gmm_jax.nn.config import MoEConfig as MoEConfig
from gmm_jax.nn.grouped_linear import GroupedLinear as GroupedLinear
from gmm_jax.nn.grouped_linear import grouped_kernel_init as grouped_kernel_init
from gmm_jax.nn.hf import from_transformers as from_transformers
from gmm_jax.nn.hf import to_transformers as to_transformers
from gmm_jax.nn.linen import grouped_linear_linen as grouped_linear_linen
from gmm_jax.nn.linen import moe_linen as moe_linen
from gmm_jax.nn.moe import MoE as MoE
from gmm_jax.nn.presets import MOE_PRESETS as MOE_PRESETS
from gmm_jax.nn.router import Router as Router
from gmm_jax.nn.router import Routing as Routing
from gmm_jax.nn.router import RoutingBias as RoutingBias
from gmm_jax.nn.shared import SharedExperts as SharedExperts
