"""The Python examples of the README and of the docs pages that hold the usage examples run as
written (with small operands predefined for the blocks that use `x`, `w` and `sizes`)."""

from __future__ import annotations

import pathlib
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Each page, how many Python blocks it holds at least, and which.
PAGES = {
    "README.md": (1, "the jit'd gmm with traced group sizes"),
    "docs/gmm.md": (3, "usage, checkify and fused MoE examples"),
    "docs/quantization.md": (2, "quantization and fp8 training examples"),
    "docs/sharding.md": (2, "plain-jit and explicit sharding examples"),
    "docs/kernels.md": (1, "the tiling record example"),
}


def _blocks(page: str) -> list[str]:
  text = (ROOT / page).read_text()
  return [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", text, re.S)]


def _namespace() -> dict:
  rng = np.random.default_rng(0)
  import gmm_jax
  from jax.sharding import Mesh
  mesh1d = Mesh(np.array(jax.devices()[:4]), ("expert",))
  namespace = {  # later blocks assume the usage block's imports
      "jax": jax, "jnp": jnp, "np": np, "gmm_jax": gmm_jax, "mesh1d": mesh1d,
      "expert_ids": jnp.asarray(rng.integers(0, 4, 64), jnp.int32),
      "x": jnp.asarray(rng.standard_normal((64, 128)), jnp.float32),
      "w": jnp.asarray(rng.standard_normal((4, 128, 32)) / 11, jnp.float32),
      "sizes": jnp.asarray([20, 0, 30, 10], jnp.int32),
      # the fused MoE block: x's 64 tokens routed top-2 over E=4 experts
      "E": 4, "top_e": jnp.asarray(rng.integers(0, 4, (64, 2)), jnp.int32),
      "top_p": jnp.asarray(rng.random((64, 2)), jnp.float32),
      "w_gate_up": jnp.asarray(rng.standard_normal((4, 128, 64)) / 11, jnp.float32),
      "w_down": jnp.asarray(rng.standard_normal((4, 32, 128)) / 6, jnp.float32),
  }
  namespace["x_bf16"] = namespace["x"].astype(jnp.bfloat16)
  return namespace


@pytest.mark.parametrize("page", sorted(PAGES))
def test_python_blocks_run(page):
  blocks = _blocks(page)
  count, which = PAGES[page]
  assert len(blocks) >= count, f"{page}: {which}"
  namespace = _namespace()
  for block in blocks:  # each block on its own copy of the operands
    scope = dict(namespace)
    exec(compile(block, str(ROOT / page), "exec"), scope)  # noqa: S102
    assert "y" not in scope or isinstance(scope["y"], jax.Array)
