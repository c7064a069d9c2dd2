"""Pallas kernels of gmm_jax, installed as ``gmm_jax.pallas``.

This folder holds kernels only (``tpu/``, ``gpu/`` and shared BlockSpec helpers in
``common.py``); they consume the tile metadata of ``gmm_jax._src.layout`` and are registered
with the dispatcher by ``gmm_jax._src.dispatch``. Never import it as a top-level ``pallas``.
"""
