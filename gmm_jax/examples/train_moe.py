"""Train a small byte-level mixture-of-experts language model on CPU.

``python -m gmm_jax.examples.train_moe [--steps N] [--layers L] [--experts E] ...``

The model is a decoder-only transformer: byte embedding + learned positions, then L blocks
of pre-RMSNorm causal self-attention (plain jnp) and a `gmm_jax.nn.MoE` feed-forward (E
SwiGLU experts, top-k routing, dropless: each expert's three projections are gmm calls over
the tokens routed to it), a final RMSNorm and a linear head over the 256 byte values. The
loss is the next-byte cross-entropy plus the MoE's load-balancing loss (x0.01) and router
z-loss (x0.001); the optimizer is optax's AdamW with warmup and cosine decay.

The text is bundled with the package (``gmm_jax/examples/data/gmm_jax_docs.txt``): the
project's own documentation, the README and the docs pages as plain text without their code
blocks, 117 KB of English about grouped matmuls (built by ``tools/make_corpus.py`` in the
repository; see ``data/README.md``); the last 10% is held out.

It prints a progress bar with tokens/s, the held-out loss periodically, the initial and final
loss and a sample of generated text, records every layer's expert load at every step, and
writes a plot of the loss and the expert load (``--plot``, default ``train_moe.png``;
``--no-plot`` to skip). `main(argv)` returns the results as a dict.

Needs the Flax extra, optax and matplotlib (``pip install "gmm_jax[test]"``).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from importlib import resources
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gmm_jax import nn

VOCAB = 256  # bytes
DATA_FILES = ("gmm_jax_docs.txt",)
LOAD_BALANCING_WEIGHT = 0.01
ROUTER_Z_WEIGHT = 1e-3
PROMPT = b"Grouped matrix multiplication"


def load_text() -> bytes:
  """The bundled training text (the files of `DATA_FILES` concatenated), as bytes."""
  root = resources.files("gmm_jax.examples") / "data"
  return b"".join((root / name).read_bytes() for name in DATA_FILES)


# --------------------------------------------------------------------------- the model


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention written out in jnp (softmax in float32)."""

  def __init__(self, embed: int, heads: int, *, dtype: Any, rngs: nnx.Rngs):
    if embed % heads:
      raise ValueError(f"--embed ({embed}) must be a multiple of the heads ({heads})")
    self.heads = heads
    self.qkv = nnx.Linear(embed, 3 * embed, use_bias=False, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(embed, embed, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    b, t, d = x.shape
    q, k, v = jnp.moveaxis(self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads), 2, 0)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    scores = scores / math.sqrt(d // self.heads)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d))


def router_load(moe: nn.MoE, h):
  """Fraction of the top-k assignments each expert gets, recomputed from the router
  (for `nn.MoE` versions whose aux dict has no "expert_load")."""
  logits = moe.router(h.reshape(-1, h.shape[-1])).astype(jnp.float32)
  _, top_e = jax.lax.top_k(logits, moe.top_k)
  hot = jax.nn.one_hot(top_e, moe.num_experts, dtype=jnp.float32)  # [T, k, E]
  return jax.lax.stop_gradient(jnp.mean(jnp.sum(hot, axis=1), axis=0) / moe.top_k)


class Block(nnx.Module):
  """Pre-norm transformer block with a routed MoE feed-forward."""

  def __init__(self, embed: int, heads: int, mlp: int, experts: int, top_k: int, *,
               dtype: Any, rngs: nnx.Rngs, quantization: str | None = None):
    self.attn_norm = nnx.RMSNorm(embed, dtype=dtype, rngs=rngs)
    self.attn = CausalSelfAttention(embed, heads, dtype=dtype, rngs=rngs)
    self.moe_norm = nnx.RMSNorm(embed, dtype=dtype, rngs=rngs)
    self.moe = nn.MoE(experts, embed, mlp, top_k=top_k, dtype=dtype, rngs=rngs,
                      quantization=quantization)

  def __call__(self, x):
    x = x + self.attn(self.attn_norm(x))
    h = self.moe_norm(x)
    y, aux = self.moe(h)
    if "expert_load" in aux:  # the block's own count, as a fraction of the assignments
      load = jax.lax.stop_gradient(aux["expert_load"].astype(jnp.float32))
      load = load / jnp.maximum(jnp.sum(load), 1e-9)
    else:
      load = router_load(self.moe, h)
    aux = {"load_balancing_loss": aux["load_balancing_loss"],
           "router_z_loss": aux["router_z_loss"], "expert_load": load}
    return x + y.astype(x.dtype), aux


class MoELM(nnx.Module):
  """Byte-level decoder-only transformer whose FFNs are `gmm_jax.nn.MoE` blocks."""

  def __init__(self, *, seq: int, embed: int, heads: int, mlp: int, layers: int,
               experts: int, top_k: int, dtype: Any = None, rngs: nnx.Rngs,
               quantization: str | None = None):
    init = nnx.initializers.normal(0.02)
    self.tokens = nnx.Embed(VOCAB, embed, dtype=dtype, embedding_init=init, rngs=rngs)
    self.positions = nnx.Embed(seq, embed, dtype=dtype, embedding_init=init, rngs=rngs)
    self.blocks = nnx.List([Block(embed, heads, mlp, experts, top_k, dtype=dtype, rngs=rngs,
                                  quantization=quantization)
                            for _ in range(layers)])
    self.norm = nnx.RMSNorm(embed, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(embed, VOCAB, use_bias=False, dtype=dtype, kernel_init=init,
                           rngs=rngs)

  def __call__(self, ids):
    """ids ``[B, T]`` (uint8/int) -> logits ``[B, T, 256]`` float32 and the aux dict:
    the mean load-balancing and z losses over layers, and ``expert_load`` ``[L, E]``."""
    x = self.tokens(ids) + self.positions(jnp.arange(ids.shape[1]))[None]
    auxes = []
    for block in self.blocks:
      x, aux = block(x)
      auxes.append(aux)
    logits = self.head(self.norm(x)).astype(jnp.float32)
    return logits, {
        "load_balancing_loss": jnp.mean(jnp.stack([a["load_balancing_loss"] for a in auxes])),
        "router_z_loss": jnp.mean(jnp.stack([a["router_z_loss"] for a in auxes])),
        "expert_load": jnp.stack([a["expert_load"] for a in auxes]),
    }

  def router_probs(self, ids):
    """The router's softmax over the experts for every byte, in every layer:
    ``[L, B, T, E]`` (the top-k of each row are the experts that byte is sent to)."""
    x = self.tokens(ids) + self.positions(jnp.arange(ids.shape[1]))[None]
    probs = []
    for block in self.blocks:
      h = block.moe_norm(x + block.attn(block.attn_norm(x)))
      probs.append(jax.nn.softmax(block.moe.router(h).astype(jnp.float32), axis=-1))
      x, _ = block(x)
    return jnp.stack(probs)


def loss_fn(model: MoELM, x, y):
  logits, aux = model(x)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  total = (ce + LOAD_BALANCING_WEIGHT * aux["load_balancing_loss"]
           + ROUTER_Z_WEIGHT * aux["router_z_loss"])
  return total, (ce, aux)


# ------------------------------------------------------------------------ the training


def batches(data: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
  """Random windows of the text: inputs ``[B, T]`` and their next bytes ``[B, T]``."""
  while True:
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    window = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
    yield window[:, :-1], window[:, 1:]


def eval_batches(data: np.ndarray, batch: int, seq: int, count: int):
  """Fixed, evenly spaced windows of the held-out text (the same at every evaluation)."""
  starts = np.linspace(0, len(data) - seq - 1, count * batch).astype(np.int64)
  window = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
  window = window.reshape(count, batch, seq + 1)
  return [(w[:, :-1], w[:, 1:]) for w in window]


class ProgressBar:
  """A one-line text progress bar redrawn in place with a carriage return."""

  def __init__(self, total: int, stream=None, width: int = 28, min_interval: float = 0.5):
    self.total, self.width, self.min_interval = total, width, min_interval
    self.stream = stream if stream is not None else sys.stdout
    self.first = None
    self.last_draw = -math.inf
    self.line = ""

  def update(self, step: int, loss: float, tokens_per_s: float, force: bool = False):
    now = time.perf_counter()
    if not force and (now - self.last_draw < self.min_interval or step >= self.total):
      return  # throttled; the last step is drawn by the final forced update
    self.last_draw = now
    if self.first is None:  # the rate is measured from the first step drawn (compiled)
      self.first = (step, now)
    done = int(self.width * step / self.total)
    steps_timed, seconds = step - self.first[0], now - self.first[1]
    eta = (f"{(self.total - step) * seconds / steps_timed:4.0f}s" if steps_timed and seconds
           else "   ?")
    speed = f"{tokens_per_s:,.0f} tok/s" if tokens_per_s else "compiled"
    self.line = (f"[{'#' * done}{'.' * (self.width - done)}] {step}/{self.total} "
                 f"loss {loss:.3f} | {speed} | eta {eta}")
    self.stream.write("\r" + self.line)
    self.stream.flush()

  def print(self, message: str):
    """A log line above the bar (the bar is redrawn at the next update)."""
    self.stream.write("\r" + " " * len(self.line) + "\r" + message + "\n")
    self.stream.flush()
    self.last_draw = -math.inf

  def close(self):
    self.stream.write("\n")
    self.stream.flush()


def parse_args(argv: Sequence[str] | None):
  p = argparse.ArgumentParser(prog="python -m gmm_jax.examples.train_moe",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=600, help="optimizer steps (default 600)")
  p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
  p.add_argument("--experts", type=int, default=8, help="experts per MoE (default 8)")
  p.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
  p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
  p.add_argument("--seq", type=int, default=128, help="bytes per sequence (default 128)")
  p.add_argument("--embed", type=int, default=128, help="model width (default 128)")
  p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
  p.add_argument("--mlp", type=int, default=256, help="expert FFN width (default 256)")
  p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
  p.add_argument("--seed", type=int, default=0, help="parameters and batches (default 0)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="compute dtype; parameters stay float32 (default float32)")
  p.add_argument("--quantization", choices=("none", "fp8", "fp8_e5m2_grads"),
                 default="none",
                 help="fp8 training of the experts' gmms (forward and both backward gmms "
                      "in fp8, blockwise scales; default none)")
  p.add_argument("--plot", default="train_moe.png",
                 help="where to write the loss / expert-load plot (default train_moe.png)")
  p.add_argument("--no-plot", action="store_true", help="write no plot")
  p.add_argument("--log-every", type=int, default=None,
                 help="steps between held-out evaluations (default steps/10)")
  p.add_argument("--sample", type=int, default=200,
                 help="bytes of text to generate after training (default 200; 0: none)")
  args = p.parse_args(argv)
  for name in ("steps", "layers", "experts", "top_k", "batch", "seq", "embed", "heads", "mlp"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be positive")
  if not args.top_k <= args.experts:
    p.error(f"--top-k ({args.top_k}) must be at most --experts ({args.experts})")
  return args


def main(argv: Sequence[str] | None = None, *, stream=None) -> dict[str, Any]:
  """Trains as the command line says; returns the results (see the keys below)."""
  args = parse_args(argv)
  out = stream if stream is not None else sys.stdout
  data = np.frombuffer(load_text(), dtype=np.uint8)
  split = int(0.9 * len(data))
  train, held_out = data[:split], data[split:]
  if len(held_out) < args.seq + 2:
    raise ValueError(f"--seq {args.seq} is longer than the held-out text ({len(held_out)})")
  model, optimizer = _model_and_optimizer(args)
  params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  graphdef, state = nnx.split((model, optimizer))
  train_step, evaluate = _step_functions(
      graphdef, eval_batches(held_out, args.batch, args.seq, count=4))
  print(f"gmm_jax MoE LM: {args.layers} layers, {args.experts} experts (top-{args.top_k}), "
        f"embed {args.embed}, mlp {args.mlp}, {params:,} parameters, {args.dtype}"
        f"{'' if args.quantization == 'none' else ' + ' + args.quantization + ' experts'}, "
        f"{jax.default_backend()}", file=out)
  print(f"text: {len(data):,} bytes ({len(train):,} train, {len(held_out):,} held out); "
        f"{args.steps} steps of {args.batch}x{args.seq} bytes", file=out)
  log_every = args.log_every or max(1, args.steps // 10)
  stream_of_batches = batches(train, args.batch, args.seq, np.random.default_rng(args.seed))
  initial_loss = evaluate(state)
  print(f"held-out loss before training: {initial_loss:.3f} "
        f"(uniform over bytes: {math.log(VOCAB):.3f})", file=out)
  state, run = _train(args, state, train_step, evaluate, stream_of_batches, log_every, out)
  run["evals"].insert(0, (0, initial_loss))
  model, optimizer = nnx.merge(graphdef, state)
  load_history = np.stack(run["loads"])  # [steps, layers, experts]
  _print_summary(run, load_history, log_every, out)
  sample = ""
  if args.sample:
    sample = generate(model, PROMPT, args.sample, args.seq, seed=args.seed)
    print("sample: " + repr(sample), file=out)
  plot = None
  if not args.no_plot:
    plot = write_plot(args.plot, run["losses"], run["evals"], load_history, args)
    print(f"plot: {plot}", file=out)
  return {
      "initial_loss": initial_loss,        # held-out cross-entropy (nats/byte) at step 0
      "final_loss": run["evals"][-1][1],   # held-out cross-entropy after the last step
      "train_losses": run["losses"],       # per step
      "eval_losses": run["evals"],         # (step, held-out loss) pairs
      "load_balancing_losses": run["balance"],  # per step (mean over layers)
      "expert_load": load_history,         # [steps, layers, experts], rows sum to 1
      "tokens_per_s": run["tokens_per_s"],  # training throughput after compilation
      "compile_seconds": run["compile_seconds"],  # the first step, compilation included
      "seconds": run["seconds"],           # the training loop, evaluations included
      "parameters": params,
      "sample": sample,
      "plot": plot,
      "model": model,
      "args": vars(args),
  }


def _model_and_optimizer(args: argparse.Namespace) -> tuple[MoELM, nnx.Optimizer]:
  """The model the arguments describe and its AdamW (warmup, cosine decay, clipping)."""
  dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
  model = MoELM(seq=args.seq, embed=args.embed, heads=args.heads, mlp=args.mlp,
                layers=args.layers, experts=args.experts, top_k=args.top_k, dtype=dtype,
                rngs=nnx.Rngs(args.seed),
                quantization=None if args.quantization == "none" else args.quantization)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, warmup_steps=max(1, min(50, args.steps // 10)),
      decay_steps=max(2, args.steps), end_value=0.1 * args.lr)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b2=0.95, weight_decay=0.01))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _step_functions(graphdef, held_out_batches):
  """The jitted training step ``(state, x, y) -> (state, ce, aux)`` on the split (model,
  optimizer) state (donated), and the held-out loss ``state -> float``."""
  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    (_, (ce, aux)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, x, y)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), ce, aux

  @jax.jit
  def eval_step(state, x, y):
    model, _ = nnx.merge(graphdef, state)
    return loss_fn(model, x, y)[1][0]

  def evaluate(state):
    return float(np.mean([eval_step(state, x, y) for x, y in held_out_batches]))

  return train_step, evaluate


def _train(args, state, train_step, evaluate, stream_of_batches, log_every: int, out):
  """The training loop, with its progress bar and the held-out loss every `log_every` steps:
  (the final state, the run's record: per-step losses, balance losses and expert loads, the
  (step, held-out loss) pairs, tokens/s, compile and total seconds)."""
  losses, balance, loads, evals = [], [], [], []
  bar = ProgressBar(args.steps, out)
  start = time.perf_counter()
  timed_start = None  # the first step (compilation) is not counted in tokens/s
  tokens_per_s = 0.0
  eval_seconds = 0.0
  for step in range(1, args.steps + 1):
    x, y = next(stream_of_batches)
    state, ce, aux = train_step(state, x, y)
    losses.append(float(ce))
    balance.append(float(aux["load_balancing_loss"]))
    loads.append(np.asarray(aux["expert_load"]))
    now = time.perf_counter()
    if timed_start is None:
      timed_start, compile_seconds = now, now - start
    elif now > timed_start + eval_seconds:
      tokens_per_s = (step - 1) * args.batch * args.seq / (now - timed_start - eval_seconds)
    bar.update(step, losses[-1], tokens_per_s)
    if step % log_every == 0 or step == args.steps:
      t0 = time.perf_counter()
      evals.append((step, evaluate(state)))
      eval_seconds += time.perf_counter() - t0
      bar.print(f"step {step:5d}  train loss {np.mean(losses[-log_every:]):.3f}  "
                f"held-out loss {evals[-1][1]:.3f}  load-balancing loss {balance[-1]:.3f}")
  bar.update(args.steps, losses[-1], tokens_per_s, force=True)
  bar.close()
  return state, dict(losses=losses, balance=balance, loads=loads, evals=evals,
                     tokens_per_s=tokens_per_s, compile_seconds=compile_seconds,
                     seconds=time.perf_counter() - start)


def _print_summary(run: dict, load_history: np.ndarray, log_every: int, out) -> None:
  """The losses before and after, the throughput and each layer's expert load over the
  last 10% of the steps."""
  losses, evals = run["losses"], run["evals"]
  last = load_history[-max(1, len(losses) // 10):].mean(axis=0)
  print(f"held-out loss: {evals[0][1]:.3f} -> {evals[-1][1]:.3f}; train loss "
        f"{losses[0]:.3f} -> {np.mean(losses[-log_every:]):.3f}", file=out)
  print(f"{run['tokens_per_s']:,.0f} tokens/s after compilation "
        f"({run['compile_seconds']:.1f} s); {run['seconds']:.1f} s in all", file=out)
  for layer, row in enumerate(last):
    print(f"expert load, layer {layer} (fraction of assignments, last 10% of steps): "
          + " ".join(f"{v:.2f}" for v in row), file=out)


def generate(model: MoELM, prompt: bytes, length: int, seq: int, *, seed: int = 0,
             temperature: float = 0.8) -> str:
  """Samples `length` bytes after `prompt` (a window of the last `seq` bytes as context)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def next_logits(state, window, position):
    logits, _ = nnx.merge(graphdef, state)(window[None])
    return logits[0, position]

  text = list(prompt)
  rng = np.random.default_rng(seed)
  for _ in range(length):
    context = text[-seq:]
    window = np.zeros(seq, np.int32)
    window[:len(context)] = context
    logits = np.asarray(next_logits(state, window, len(context) - 1), np.float64)
    p = np.exp((logits - logits.max()) / temperature)
    text.append(int(rng.choice(VOCAB, p=p / p.sum())))
  return bytes(text).decode("utf-8", errors="replace")


def write_plot(path, losses, evals, load_history, args) -> str:
  """Loss over steps (top) and every layer's expert load over steps (one panel each)."""
  layers, experts = load_history.shape[1:]
  fig = Figure(figsize=(7, 2.4 * (1 + layers)), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(1 + layers, 1, sharex=True, squeeze=False)[:, 0]
  steps = np.arange(1, len(losses) + 1)
  window = max(1, len(losses) // 25)
  smooth = lambda v: np.convolve(v, np.ones(window) / window, mode="valid")

  ax = axes[0]
  ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=0.8, label="train (per step)")
  ax.plot(steps[window - 1:], smooth(np.asarray(losses)), color="tab:blue",
          label=f"train ({window}-step mean)")
  ax.plot(*zip(*evals), "o-", color="tab:orange", label="held out")
  ax.set_ylabel("cross-entropy (nats/byte)")
  ax.set_title(f"byte-level MoE LM: {layers} layers, {experts} experts, top-{args.top_k}, "
               f"{args.dtype}")
  ax.legend(loc="upper right", fontsize="small")
  ax.grid(alpha=0.3)

  for layer in range(layers):
    ax = axes[1 + layer]
    for e in range(experts):
      ax.plot(steps[window - 1:], smooth(load_history[:, layer, e]), lw=1.2, label=f"e{e}")
    ax.axhline(1 / experts, color="black", ls="--", lw=0.8)
    ax.set_ylabel(f"layer {layer}\nexpert load")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
  axes[1].set_title("fraction of the top-k assignments per expert (dashed: balanced)",
                    fontsize="small")
  axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small",
                 ncol=1 + (experts - 1) // 16)
  axes[-1].set_xlabel("step")
  fig.savefig(path, dpi=110)
  return str(path)


if __name__ == "__main__":
  main()
