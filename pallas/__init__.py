"""Pallas kernels of gmm_jax, installed as ``gmm_jax.pallas``.

This folder holds kernels only (``tpu/``, ``gpu/`` and the shared preamble and helpers in
``common.py``); they consume the group metadata of ``gmm_jax._src.core.metadata`` and are
registered with the dispatcher by ``gmm_jax._src.backends.builtin``. Never import it as a
top-level ``pallas``.
"""
