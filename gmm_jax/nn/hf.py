"""Weights in and out of Hugging Face transformers MoE blocks: `from_transformers` builds the
`MoE` of a transformers MoE block (its config and its weights), `to_transformers` writes an
`MoE`'s weights back in transformers' layout.

Neither torch nor transformers is imported here: a block's tensors are read through its
``state_dict()`` (``.detach().cpu()`` then numpy), and a config may be the transformers
object or its ``to_dict()``, so that weights saved as numpy arrays load without torch.

The parts: `hf_architectures` (the architectures known, `ARCHITECTURES`), `hf_options`
(their configs -> the `MoE` arguments), `hf_weights` (their tensor layouts <-> nn.MoE's),
`hf_unsupported` (the MoE blocks refused, and why); here the `MoE` side (its parameters by
canonical name) and the configs read from a block's modules. `to_transformers` writes
transformers 5.x's layout.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gmm_jax.nn.hf_architectures import Architecture, architecture_of
from gmm_jax.nn.hf_options import config_dict, config_field
from gmm_jax.nn.hf_weights import Tensors, read_weights, write_weights
from gmm_jax.nn.moe import MoE

# --------------------------------------------------------------------------- nn.MoE side

# Canonical name -> the attribute path of the parameter in nn.MoE.
_PARAMS = {
    "router_kernel": ("router", "kernel"),
    "router_bias": ("router", "bias"),
    "routing_bias": ("routing_bias",),
    "experts_w_in": ("gate_up|up", "kernel"),
    "experts_b_in": ("gate_up|up", "bias"),
    "experts_w_down": ("down", "kernel"),
    "experts_b_down": ("down", "bias"),
    "shared_w_in": ("shared", "up", "kernel"),
    "shared_w_down": ("shared", "down", "kernel"),
    "shared_gate": ("shared", "gate", "kernel"),
    "output_bias": ("output_bias",),
}


def _variable(moe, path):
  node = moe
  for part in path:
    for name in part.split("|"):
      found = getattr(node, name, None)
      if found is not None:
        break
    node = found
    if node is None:
      return None
  return node


def _assign(variable, value):
  if hasattr(variable, "set_value"):
    variable.set_value(value)
  else:
    variable.value = value


def _moe_arrays(moe) -> dict:
  out = {}
  for name, path in _PARAMS.items():
    variable = _variable(moe, path)
    if variable is not None:
      out[name] = np.asarray(variable[...])
  return out


def _moe_arguments(arch: Architecture, options: dict, seq_len, overrides) -> dict:
  del seq_len  # Switch's per-sequence capacity is nn.MoE's expert_capacity: no length needed
  kwargs = dict(options)
  if "expert_capacity" in kwargs:
    kwargs["capacity_per"] = "sequence"
    if "capacity_factor" in overrides:  # a factor (or None: dropless) replaces it
      del kwargs["expert_capacity"]
  kwargs["load_balancing_convention"] = "transformers"
  kwargs.update(overrides)
  return kwargs


def from_transformers(block_or_config, state_dict: Mapping[str, Any] | None = None, *,
                      rngs: nnx.Rngs | None = None, config=None, prefix: str = "",
                      seq_len: int | None = None, **overrides) -> MoE:
  """The `MoE` of a Hugging Face transformers MoE block, with its weights.

  Args:
    block_or_config: a transformers MoE block (``model.model.layers[i].mlp``; for
      GraniteMoeShared and GraniteMoeHybrid the decoder layer ``model.model.layers[i]``,
      whose routed block and shared MLP make its FFN: its config is found on it or its
      submodules, its weights are its ``state_dict()``), or a config
      (a transformers config, its ``to_dict()`` or that as JSON) with `state_dict`.
    state_dict: the block's tensors by name (numpy, torch or jax arrays), as its
      ``state_dict()`` names them (after `prefix`); with a block: instead of its own.
    rngs: for the layer's construction (the weights are then replaced); default
      ``nnx.Rngs(0)``.
    config: with a block: its config, where the block does not keep one.
    prefix: only the tensors whose names start with it, the prefix removed (e.g.
      ``"model.layers.3.mlp."`` of a whole model's state dict).
    seq_len: accepted for compatibility and not needed: Switch's per-sequence
      ``expert_capacity`` becomes nn.MoE's ``expert_capacity`` with
      ``capacity_per="sequence"``, whatever the sequences' length.
    **overrides: more `MoE` arguments (``dtype``, ``param_dtype``, ``fused``,
      ``implementation``, ...); they replace the ones the config gives.

  Returns:
    an `MoE` computing what the block computes (forward, gradients, expert choice); its
    ``aux["load_balancing_loss"]`` is transformers' ``load_balancing_loss_func`` value
    (``load_balancing_convention="transformers"``).

  Raises:
    NotImplementedError: an architecture, activation or option nn.MoE cannot express.
    ValueError: tensors missing, left over or of the wrong shape for the config.
  """
  if hasattr(block_or_config, "state_dict") and callable(block_or_config.state_dict):
    block = block_or_config
    found = config if config is not None else _any_config(block)
    arch = architecture_of(type(block).__name__, None if found is None
                         else config_field(config_dict(found), "model_type", default=None))
    config = _block_config(arch, block) if config is None else config
    state_dict = block.state_dict() if state_dict is None else state_dict
  else:
    config = block_or_config
    if state_dict is None:
      raise ValueError("from_transformers(config) needs the state_dict of the block")
    if isinstance(config, str):
      config = config_dict(config)
    model_type = config_field(config, "model_type", default=None)
    if model_type is None:
      raise ValueError("the config has no model_type: cannot tell its architecture")
    arch = architecture_of(model_type)
  options = arch.options(config)
  tensors = Tensors(state_dict, prefix, arch.reads)
  canonical = read_weights(arch, tensors, options)
  kwargs = _moe_arguments(arch, options, seq_len, overrides)
  kwargs.setdefault("param_dtype", canonical["experts_w_in"].dtype)
  sizes = kwargs.pop("num_experts"), kwargs.pop("embed"), kwargs.pop("mlp")
  if rngs is None:  # every weight comes from the state dict: no random draws
    moe = nnx.eval_shape(lambda: MoE(*sizes, rngs=nnx.Rngs(0), **kwargs))
  else:
    moe = MoE(*sizes, rngs=rngs, **kwargs)
  unset = {id(v) for _, v in nnx.iter_graph(moe) if isinstance(v, nnx.Variable)}
  for name, value in canonical.items():
    variable = _variable(moe, _PARAMS[name])
    if variable is None:
      raise ValueError(f"{arch.name}: the layer built has no parameter for {name}")
    current = variable.get_value() if hasattr(variable, "get_value") else variable.value
    if tuple(current.shape) != tuple(value.shape):
      raise ValueError(f"{arch.name}: {name} is {tuple(value.shape)}, the layer's "
                       f"{'.'.join(_PARAMS[name])} is {tuple(current.shape)}")
    _assign(variable, jnp.asarray(np.asarray(value), dtype=current.dtype))
    unset.discard(id(variable))
  if rngs is None and unset:
    names = [".".join(map(str, path)) for path, v in nnx.iter_graph(moe)
             if isinstance(v, nnx.Variable) and id(v) in unset]
    raise ValueError(f"{arch.name}: no weights in the state dict for {names}")
  return moe


def to_transformers(moe: MoE, config_or_arch, *, prefix: str = "") -> dict[str, np.ndarray]:
  """The weights of `moe` as a transformers 5.x block of that architecture stores them.

  Args:
    moe: an `MoE` (e.g. from `from_transformers`, trained).
    config_or_arch: the transformers config (object, dict or JSON) of the block, or an
      architecture name of `hf_architectures.ARCHITECTURES` / a ``model_type`` / a block class name.
    prefix: put before every name (e.g. ``"model.layers.3.mlp."``).

  Returns:
    ``{name: numpy array}``, as the block's ``state_dict()`` names them (load with
    ``block.load_state_dict({k: torch.from_numpy(v) for k, v in ...})``).

  Raises:
    ValueError: `moe` has weights the architecture does not store (they would be lost),
      lacks ones it needs, or its shapes differ from the config's.
  """
  if isinstance(config_or_arch, str) and not config_or_arch.lstrip().startswith("{"):
    arch = architecture_of(config_or_arch)
    options = dict(num_experts=moe.num_experts, embed=moe.embed, mlp=moe.mlp)
    if arch.shared and (moe.shared is not None or "shared" not in arch.optional):
      options["num_shared_experts"] = 1
    if arch.routing_bias and (moe.routing_bias is not None
                              or "routing_bias" not in arch.optional):
      options["routing_bias"] = True
  else:
    config = config_dict(config_or_arch)
    arch = architecture_of(config_field(config, "model_type"))
    options = arch.options(config)
    for name in ("num_experts", "embed", "mlp", "top_k"):
      if getattr(moe, name) != options[name]:
        raise ValueError(f"{arch.name}: the layer's {name} is {getattr(moe, name)}, the "
                         f"config's {options[name]}")
  canonical = _moe_arrays(moe)
  wanted = {"router_kernel", "experts_w_in", "experts_w_down"}
  if arch.experts == "interleaved":
    wanted |= {"experts_b_in", "experts_b_down", "router_bias"}
  if arch.name == "switch_transformers" and "router_bias" in canonical:
    wanted.add("router_bias")
  if arch.routing_bias and options.get("routing_bias"):
    wanted.add("routing_bias")
  if arch.shared and options.get("num_shared_experts"):
    wanted |= {"shared_w_in", "shared_w_down"}
  if arch.shared_gate:
    wanted.add("shared_gate")
  if arch.output_bias:
    wanted.add("output_bias")
  missing = sorted(wanted - set(canonical))
  extra = sorted(set(canonical) - wanted)
  if missing or extra:
    raise ValueError(f"{arch.name} stores {sorted(wanted)}; the layer "
                     + (f"lacks {missing}" if missing else "")
                     + (" and " if missing and extra else "")
                     + (f"has {extra}, which it would lose" if extra else ""))
  out = write_weights(arch, canonical, options)
  return {prefix + name: value for name, value in out.items()}


# --------------------------------------------------------------------------- blocks

_MODULE_ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "ReLU": "relu",
                       "GELUActivation": "gelu", "NewGELUActivation": "gelu_new",
                       "PytorchGELUTanh": "gelu_new", "GELUTanh": "gelu_new",
                       "FastGELUActivation": "gelu_fast"}


def _module_activation(module) -> str:
  name = type(module).__name__
  if name == "GELU":
    return "gelu_new" if getattr(module, "approximate", "none") == "tanh" else "gelu"
  if name not in _MODULE_ACTIVATIONS:
    raise NotImplementedError(f"activation module {name}: supported are "
                              f"{sorted(_MODULE_ACTIVATIONS)}")
  return _MODULE_ACTIVATIONS[name]


def _any_config(block):
  """The config a block or one of its submodules keeps, or None."""
  modules = block.modules() if hasattr(block, "modules") else ()
  for module in [block, *modules]:
    config = getattr(module, "config", None)
    if config is not None and (hasattr(config, "to_dict") or isinstance(config, Mapping)):
      return config
  return None


def _block_config(arch: Architecture, block):
  """The config of a block: its own or a submodule's (transformers 5.x's experts keep it);
  DBRX, JetMoE and Switch blocks keep none, their options are read from the modules."""
  for module in [block, *block.modules()]:
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_dict"):
      if arch.name == "hunyuan_v1_moe":  # per-layer lists: this layer's, from its gate
        return {**config.to_dict(), "num_experts": block.gate.num_experts,
                "moe_topk": block.gate.top_k}
      if arch.name == "ernie4_5_vl_moe":  # text or vision experts: their own width
        return {**config.to_dict(), "moe_intermediate_size": block.experts.intermediate_dim}
      return config
  if arch.name == "dbrx":
    mlp = block.experts.mlp
    return {"model_type": "dbrx", "d_model": block.experts.hidden_size,
            "ffn_config": {"moe_num_experts": block.experts.num_experts,
                           "ffn_hidden_size": block.experts.ffn_hidden_size,
                           "moe_top_k": block.top_k,
                           "moe_normalize_expert_weights": block.moe_normalize_expert_weights,
                           "ffn_act_fn": {"name": _module_activation(mlp.activation_fn)}}}
  if arch.name == "jetmoe":
    return {"model_type": "jetmoe", "hidden_size": block.input_size,
            "intermediate_size": block.hidden_size,
            "num_local_experts": block.router.num_experts,
            "num_experts_per_tok": block.router.top_k,
            "activation_function": _module_activation(block.activation)}
  if arch.name == "switch_transformers":
    first = block.experts["expert_0"]
    return {"model_type": "switch_transformers", "num_experts": block.router.num_experts,
            "d_model": first.wi.in_features, "d_ff": first.wi.out_features,
            "expert_capacity": block.router.expert_capacity,
            "router_bias": block.router.classifier.bias is not None,
            "dense_act_fn": _module_activation(first.act)}
  raise ValueError(f"{type(block).__name__} keeps no config: pass config=")
