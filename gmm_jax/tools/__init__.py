"""The project's tools, built on the public API: the benchmarks (`bench`, `bench_moe`,
`bench_decode`, `bench_fallback`) and the deviceless compiles of every kernel (`aot`) and of
whole training steps on multi-chip topologies (`aot_pod`). Each runs as
``python -m gmm_jax.tools.<name>``; ``gmm-jax-bench`` and ``gmm-jax-aot`` are console
scripts of `bench` and `aot`."""
