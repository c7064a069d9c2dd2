"""The project's tools, built on the public API: the benchmarks (`bench`, `bench_moe`,
`bench_decode`, `bench_fallback`) and the deviceless compiles of every kernel (`aot`) and of
whole training steps on multi-chip topologies (`aot_pod`). Each runs as
``python -m gmm_jax.tools.<name>``; ``gmm-jax-bench`` and ``gmm-jax-aot`` are console
scripts of `bench` and `aot`.

The other modules are parts of those commands: `bench_host` and `bench_accel` (the tables
of `bench`), `aot_cases`, `aot_code` and `aot_compile` (the cases of `aot`, reading their
compiled code, compiling one), `aot_pod_steps`, `aot_pod_hlo` and `aot_pod_compile` (the
steps of `aot_pod`, reading their HLO, compiling one), and `deviceless` (the targets `aot`
and `aot_pod` describe without the hardware)."""
