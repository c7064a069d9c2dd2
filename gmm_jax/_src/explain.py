"""`gmm_jax.explain`: what a gmm call would do, and why, read from the decisions the layers
record while the call is lowered (the quantization mode, the sharding plan, the
implementation that serves each gmm of the forward and why the others did not).

Floor 6: built on the public `gmm` (`api`), whose call it lowers (and compiles when the
operands are sharded) inside the dispatcher's recorders.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from gmm_jax._src.api import gmm
from gmm_jax._src.backends import registry
from gmm_jax._src.core.config import GmmConfig
from gmm_jax._src.core.grouped_array import GroupedArray
from gmm_jax._src.core.qarray import QArray, as_qarray, as_quantization, quant_mode
from gmm_jax._src.sharding import spec as sharding_lib


def explain(lhs: jax.typing.ArrayLike | QArray | GroupedArray | jax.ShapeDtypeStruct,
            rhs: jax.typing.ArrayLike | QArray | jax.ShapeDtypeStruct,
            group_list: jax.typing.ArrayLike | jax.ShapeDtypeStruct | None = None,
            **kwargs: Any) -> str:
  """What `gmm(lhs, rhs, group_list, **kwargs)` would do, and why: the quantization mode,
  the sharding strategy and collectives (with ``sharding=``, or the plan a call on operands
  placed on several devices was split by, arrays or ShapeDtypeStructs with a sharding:
  at trace time on Explicit axes, else by the partitioning rule under plain jit; on TPU,
  where no partitioner splits a kernel, that the call runs as the dense reference XLA
  partitions, and the fix), and which implementation serves each gmm of the forward on the
  platform it is lowered for (each skipped implementation with its reason).

  Lowers the call, and compiles it when the operands are sharded (nothing is computed);
  arguments as for `gmm`. Arrays placed on (or typed for) other devices, or
  ``jax.default_device``, decide the platform; ``platform="tpu"`` (or "gpu") explains the
  call for that platform from any machine (lowered for it; where this jax cannot lower the
  chosen kernel without such a device, the choice is still reported, with the reason).
  """
  lines = []
  lq, rq = as_qarray(lhs), as_qarray(rhs)
  probe = GmmConfig(group_type=kwargs.get("group_type") or "m", num_local=1,
                    transpose_lhs=kwargs.get("transpose_lhs", False),
                    transpose_rhs=kwargs.get("transpose_rhs", False))
  recipe = as_quantization(kwargs.get("quantization"))
  if recipe is not None:
    lines.append(
        f"quantization: fp8 training ({recipe.dtype.name} forward, {recipe.grad_dtype.name} "
        f"gradients, {recipe.block}-blocks: the forward, dlhs and drhs are blocked-mode gmms)")
  elif kwargs.get("quantize_lhs") is not None or kwargs.get("quantize_rhs") is not None:
    lines.append("quantization: dynamic (gmm quantizes the float operands; gradients "
                 f"{'straight-through' if kwargs.get('straight_through', True) else 'none'})")
  elif lq is not None or rq is not None:
    lines.append(f"quantization: {quant_mode(lq or lhs, rq or rhs, probe)}")
  else:
    lines.append("quantization: none")
  sharding = kwargs.get("sharding")
  if sharding is not None:
    lines.append(sharding_lib.plan(sharding, probe, np.ndim(lq.qvalue if lq else lhs),
                                   np.ndim(rq.qvalue if rq else rhs)).describe())
  if isinstance(group_list, (list, tuple)):
    group_list = np.asarray(group_list)
  # ``platform=`` other than the default backend's: lower for that platform (the kernels of
  # another platform cannot be lowered for this one).
  target = kwargs.get("platform")
  if target is not None:
    target = registry.normalize_platform(target)
    if target == registry.normalize_platform(jax.default_backend()):
      target = None
  with registry.record() as decisions, registry.record_plans() as plans:
    fn = jax.jit(lambda l, r, g: gmm(l, r, g, **kwargs))
    lowered, not_lowered = None, None
    if target is None:
      lowered = fn.lower(lhs, rhs, group_list)
    else:
      try:
        lowered = fn.trace(lhs, rhs, group_list).lower(
            lowering_platforms=("cuda" if target == "gpu" else target,))
      except Exception as err:  # noqa: BLE001  (the choice is made; reported below)
        not_lowered = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if lowered is not None and sharding is None and _on_several_devices(
        (lhs, rhs, group_list, kwargs.get("bias"))):
      # Plain jit with sharded operands: the partitioner picks the strategy (and the
      # per-device gmms are traced) while the program compiles.
      lowered.compile()
  for plan in plans:
    lines.append("sharding: " + plan.describe())
  lines.append("implementations (forward):")
  seen = []
  for decision in decisions:
    text = decision.describe()
    if text not in seen:
      seen.append(text)
      lines.append("  - " + text.replace("\n", "\n  "))
  if not_lowered is not None:
    lines.append(f"(the chosen kernel was not lowered for {target} here: {not_lowered})")
  return "\n".join(lines)


def _on_several_devices(tree) -> bool:
  """Whether any array (or ShapeDtypeStruct) in `tree` is placed on more than one device."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and len(getattr(sharding, "device_set", ())) > 1:
      return True
  return False
