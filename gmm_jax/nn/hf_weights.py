"""Transformers MoE blocks' tensors <-> the canonical arrays (nn.MoE's layout, named as
`gmm_jax.nn.hf` names its parameters): `Tensors` reads a state dict, `read_weights` and
`write_weights` convert each expert, router and shared-expert layout.

Expert layouts read: transformers 5.x's fused ``experts.gate_up_proj`` ``[E, 2F, D]`` (gate
rows first) and ``experts.down_proj`` ``[E, D, F]``; gpt-oss's ``[E, D, 2F]`` with gate and
up columns interleaved (and their biases); Llama 4's ``[E, D, 2F]`` (gate columns first);
DBRX's ``w1``/``v1``/``w2`` ``[E * F, D]``; Switch's per-expert ``wi``/``wo``; and
transformers 4.x's per-expert ``experts.{e}.{gate,up,down}_proj`` (Mixtral:
``w1``/``w3``/``w2``) and GraniteMoE's ``input_linear``/``output_linear``. `write_weights`
writes the 5.x layout.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from gmm_jax.nn.hf_architectures import Architecture


class Tensors:
  """A state dict's arrays by name; `take` marks a name used, so that tensors of a layout
  not read are an error rather than silently dropped."""

  def __init__(self, state_dict: Mapping[str, Any], prefix: str, reads: tuple[str, ...] = ()):
    self.arrays = {name[len(prefix):]: _to_numpy(value) for name, value in state_dict.items()
                   if name.startswith(prefix)
                   and (not reads or name[len(prefix):].startswith(reads))}
    if not self.arrays:
      raise ValueError(f"no tensors named {prefix!r}... in the state dict "
                       f"(first names: {sorted(state_dict)[:5]})")
    self.used: set[str] = set()

  def has(self, name):
    return name in self.arrays

  def take(self, name, shape=None):
    if name not in self.arrays:
      raise ValueError(f"the state dict has no {name!r}; it has {sorted(self.arrays)}")
    value = self.arrays[name]
    if shape is not None and tuple(value.shape) != tuple(shape):
      raise ValueError(f"{name} has shape {tuple(value.shape)}, the config says "
                       f"{tuple(shape)}")
    self.used.add(name)
    return value

  def check_all_used(self, arch):
    unused = sorted(set(self.arrays) - self.used)
    if unused:
      raise ValueError(f"{arch}: tensors of the state dict that this layout does not read: "
                       f"{unused}")


class _Scoped:
  """The tensors under a prefix of a `Tensors` (names without it)."""

  def __init__(self, tensors: Tensors, prefix: str):
    self.tensors, self.prefix = tensors, prefix

  def has(self, name):
    return self.tensors.has(self.prefix + name)

  def take(self, name, shape=None):
    return self.tensors.take(self.prefix + name, shape)


def _to_numpy(value) -> np.ndarray:
  """A torch tensor (``.detach().cpu()``; bfloat16 kept as ml_dtypes' bfloat16), a jax or
  numpy array -> numpy."""
  if hasattr(value, "detach"):
    value = value.detach().cpu()
    if str(value.dtype) == "torch.bfloat16":
      torch = sys.modules["torch"]  # a tensor exists: torch is imported
      return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return value.numpy()
  return np.asarray(value)


def _stack_per_expert(tensors, names, num_experts):
  return np.stack([tensors.take(names.format(e=e)) for e in range(num_experts)])


def _read_experts(arch: Architecture, tensors: Tensors, o: dict) -> dict:
  """The experts' weights in nn.MoE's layout: w_in ``[E, D, 2F]`` (gate half first) or
  ``[E, D, F]``, w_down ``[E, F, D]``, biases b_in, b_down."""
  num_experts, embed, mlp = o["num_experts"], o["embed"], o["mlp"]
  out = {}
  if arch.experts == "fused" and tensors.has("experts.gate_up_proj"):
    out["w_in"] = tensors.take("experts.gate_up_proj",
                               (num_experts, 2 * mlp, embed)).transpose(0, 2, 1)
    out["w_down"] = tensors.take("experts.down_proj",
                                 (num_experts, embed, mlp)).transpose(0, 2, 1)
  elif arch.experts == "input_output_linear" or (  # JetMoE; GraniteMoE 4.x
      arch.experts == "fused" and tensors.has("input_linear.weight")):
    out["w_in"] = tensors.take("input_linear.weight",
                               (num_experts, 2 * mlp, embed)).transpose(0, 2, 1)
    out["w_down"] = tensors.take("output_linear.weight",
                                 (num_experts, embed, mlp)).transpose(0, 2, 1)
  elif arch.experts == "fused":  # transformers 4.x: one module per expert
    names = (("w1", "w3", "w2") if tensors.has("experts.0.w1.weight")
             else ("gate_proj", "up_proj", "down_proj"))
    gate, up, down = (_stack_per_expert(tensors, f"experts.{{e}}.{n}.weight", num_experts)
                      for n in names)
    for name, value, shape in (("gate", gate, (mlp, embed)), ("up", up, (mlp, embed)),
                               ("down", down, (embed, mlp))):
      if value.shape[1:] != shape:
        raise ValueError(f"experts' {name} weights are {value.shape[1:]}, the config says "
                         f"{shape}")
    out["w_in"] = np.concatenate([gate, up], axis=1).transpose(0, 2, 1)
    out["w_down"] = down.transpose(0, 2, 1)
  elif arch.experts == "fused_in_out":
    out["w_in"] = tensors.take("experts.gate_up_proj", (num_experts, embed, 2 * mlp))
    out["w_down"] = tensors.take("experts.down_proj", (num_experts, mlp, embed))
  elif arch.experts == "interleaved":
    w = tensors.take("experts.gate_up_proj", (num_experts, embed, 2 * mlp))
    b = tensors.take("experts.gate_up_proj_bias", (num_experts, 2 * mlp))
    out["w_in"] = np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1)
    out["b_in"] = np.concatenate([b[..., 0::2], b[..., 1::2]], axis=-1)
    out["w_down"] = tensors.take("experts.down_proj", (num_experts, mlp, embed))
    out["b_down"] = tensors.take("experts.down_proj_bias", (num_experts, embed))
  elif arch.experts == "dbrx":
    gate, up, down = (tensors.take(f"experts.mlp.{n}", (num_experts * mlp, embed)).reshape(
        num_experts, mlp, embed) for n in ("w1", "v1", "w2"))
    out["w_in"] = np.concatenate([gate, up], axis=1).transpose(0, 2, 1)
    out["w_down"] = down
  elif arch.experts == "per_expert":
    wi = _stack_per_expert(tensors, "experts.expert_{e}.wi.weight", num_experts)
    wo = _stack_per_expert(tensors, "experts.expert_{e}.wo.weight", num_experts)
    if wi.shape[1:] != (mlp, embed) or wo.shape[1:] != (embed, mlp):
      raise ValueError(f"experts' wi/wo are {wi.shape[1:]}/{wo.shape[1:]}, the config says "
                       f"{(mlp, embed)}/{(embed, mlp)}")
    out["w_in"], out["w_down"] = wi.transpose(0, 2, 1), wo.transpose(0, 2, 1)
  else:
    raise AssertionError(arch.experts)
  return out


def _write_experts(arch: Architecture, w: dict, o: dict) -> dict:
  """The inverse of `_read_experts`, to transformers 5.x's layout."""
  num_experts, mlp = o["num_experts"], o["mlp"]
  if arch.experts == "fused":
    return {"experts.gate_up_proj": w["w_in"].transpose(0, 2, 1),
            "experts.down_proj": w["w_down"].transpose(0, 2, 1)}
  if arch.experts == "fused_in_out":
    return {"experts.gate_up_proj": w["w_in"], "experts.down_proj": w["w_down"]}
  if arch.experts == "input_output_linear":
    return {"input_linear.weight": w["w_in"].transpose(0, 2, 1),
            "output_linear.weight": w["w_down"].transpose(0, 2, 1)}
  if arch.experts == "interleaved":
    def interleave(a):
      out = np.empty_like(a)
      out[..., 0::2], out[..., 1::2] = a[..., :mlp], a[..., mlp:]
      return out
    return {"experts.gate_up_proj": interleave(w["w_in"]),
            "experts.gate_up_proj_bias": interleave(w["b_in"]),
            "experts.down_proj": w["w_down"], "experts.down_proj_bias": w["b_down"]}
  if arch.experts == "dbrx":
    gate_up = w["w_in"].transpose(0, 2, 1)  # [E, 2F, D]
    flat = lambda a: a.reshape(num_experts * mlp, -1)  # noqa: E731
    return {"experts.mlp.w1": flat(gate_up[:, :mlp]), "experts.mlp.v1": flat(gate_up[:, mlp:]),
            "experts.mlp.w2": flat(w["w_down"])}
  if arch.experts == "per_expert":
    out = {}
    for e in range(num_experts):
      out[f"experts.expert_{e}.wi.weight"] = w["w_in"][e].T
      out[f"experts.expert_{e}.wo.weight"] = w["w_down"][e].T
    return out
  raise AssertionError(arch.experts)


def read_weights(arch: Architecture, tensors: Tensors, o: dict) -> dict:
  """The state dict -> the canonical arrays (`gmm_jax.nn.hf`'s `_PARAMS` names, nn.MoE's layout)."""
  embed = o["embed"]
  num_experts = o["num_experts"] + o.get("num_identity_experts", 0)  # the router's
  router = arch.router
  if arch.name == "granitemoe" and not tensors.has(router):  # transformers 4.x
    router = "router.layer.weight"
  canonical = {"router_kernel": tensors.take(router, (num_experts, embed)).T}
  if o.get("router_bias"):
    canonical["router_bias"] = tensors.take(router.rsplit(".", 1)[0] + ".bias",
                                            (num_experts,))
  if arch.routing_bias and o.get("routing_bias"):
    shape = (1, num_experts) if arch.routing_bias_2d else (num_experts,)
    canonical["routing_bias"] = tensors.take(arch.routing_bias, shape).reshape(num_experts)
  experts = _read_experts(arch, _Scoped(tensors, arch.experts_at), o)
  canonical.update({f"experts_{k}": v for k, v in experts.items()})
  if arch.shared and o.get("num_shared_experts"):
    shared_mlp = o["shared_mlp"]
    if arch.shared_layout == "input_output":
      canonical["shared_w_in"] = tensors.take(f"{arch.shared}.input_linear.weight",
                                              (2 * shared_mlp, embed)).T
      canonical["shared_w_down"] = tensors.take(f"{arch.shared}.output_linear.weight",
                                                (embed, shared_mlp)).T
    else:
      gate, up = (tensors.take(f"{arch.shared}.{n}_proj.weight", (shared_mlp, embed))
                  for n in ("gate", "up"))
      canonical["shared_w_in"] = np.concatenate([gate, up], axis=0).T
      canonical["shared_w_down"] = tensors.take(f"{arch.shared}.down_proj.weight",
                                                (embed, shared_mlp)).T
  elif arch.shared and arch.zero_width_shared:  # read (where there) and dropped
    for name, shape in _zero_width_shared(arch, embed).items():
      if tensors.has(name):
        tensors.take(name, shape)
  if arch.shared_gate:
    canonical["shared_gate"] = tensors.take(arch.shared_gate, (1, embed)).T
  if arch.output_bias:
    canonical["output_bias"] = tensors.take(arch.output_bias, (embed,))
  tensors.check_all_used(arch.name)
  return canonical


def _zero_width_shared(arch: Architecture, embed: int) -> dict:
  """The shapes of the shared expert's tensors that a block without one keeps (transformers
  builds it ``moe_intermediate_size * n_shared_experts`` = 0 wide)."""
  return {f"{arch.shared}.gate_proj.weight": (0, embed),
          f"{arch.shared}.up_proj.weight": (0, embed),
          f"{arch.shared}.down_proj.weight": (embed, 0)}


def write_weights(arch: Architecture, canonical: dict, o: dict) -> dict:
  out = {arch.router: canonical["router_kernel"].T}
  if "router_bias" in canonical:
    out[arch.router.rsplit(".", 1)[0] + ".bias"] = canonical["router_bias"]
  if arch.routing_bias and "routing_bias" in canonical:
    out[arch.routing_bias] = (canonical["routing_bias"][None] if arch.routing_bias_2d
                              else canonical["routing_bias"])
  experts = _write_experts(arch, {k[len("experts_"):]: v for k, v in canonical.items()
                                  if k.startswith("experts_")}, o)
  out.update({arch.experts_at + name: value for name, value in experts.items()})
  if arch.shared and "shared_w_in" not in canonical:  # no shared experts
    if arch.zero_width_shared:
      dtype = canonical["experts_w_in"].dtype
      out.update({name: np.zeros(shape, dtype)
                  for name, shape in _zero_width_shared(arch, o["embed"]).items()})
  elif arch.shared and arch.shared_layout == "input_output":
    out[f"{arch.shared}.input_linear.weight"] = canonical["shared_w_in"].T
    out[f"{arch.shared}.output_linear.weight"] = canonical["shared_w_down"].T
  elif arch.shared:
    w_in = canonical["shared_w_in"].T  # [2Fs, D]
    half = w_in.shape[0] // 2
    out[f"{arch.shared}.gate_proj.weight"] = w_in[:half]
    out[f"{arch.shared}.up_proj.weight"] = w_in[half:]
    out[f"{arch.shared}.down_proj.weight"] = canonical["shared_w_down"].T
  if arch.shared_gate:
    out[arch.shared_gate] = canonical["shared_gate"].T
  if arch.output_bias:
    out[arch.output_bias] = canonical["output_bias"]
  return {name: np.ascontiguousarray(value) for name, value in out.items()}
