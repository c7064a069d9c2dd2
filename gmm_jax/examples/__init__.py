"""Runnable examples built on gmm_jax (they need the Flax extra and optax).

* ``python -m gmm_jax.examples.train_moe``: a small byte-level mixture-of-experts language
  model (`gmm_jax.nn.MoE` as the FFN of every layer) trained on CPU on the bundled text.
"""
