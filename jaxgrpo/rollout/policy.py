"""`jaxgrpo.Policy`: the model and its parameters behind two calls, for notebooks.

    policy = jaxgrpo.Policy.init(ModelConfig(...), seed=0)
    policy = jaxgrpo.Policy.from_pretrained("/path/to/Qwen2.5-0.5B-Instruct")
    logits = policy.logits(tokens, mask)
    out = policy.generate([[1, 5, 6], [1, 7]], SamplingParams(0.7, 0.95, 0),
                          num_samples=4, max_new_tokens=32, seed=0)
    logp_NxT, mask_NxT = policy.score([[1, 5, 6], [1, 7]], out.tokens_NxT, out.mask_NxT)

docs/python.md is the page for it, with a tested example.

`generate` uses the same compiled sampler as the trainer (sampling.compile_sampler), one
compilation per (sampling settings, num_samples, max_new_tokens, batch shape). The trainer
itself goes through `RolloutEngine`, which allows only its two profiles.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import sampling


class Policy:
  """A decoder's config, its (sharded) parameters, and the mesh they live on."""

  def __init__(self, cfg: model_lib.ModelConfig, params, mesh=None, *, pad_id: int = 0,
               eos_id: int | None = None):
    self.cfg = cfg
    self.mesh = mesh if mesh is not None else sharding_lib.make_mesh(
        {"data": -1}, jax.devices()[:1])
    self.params = sharding_lib.shard_params(params, cfg, self.mesh)
    self.pad_id, self.eos_id = pad_id, eos_id
    self._samplers = {}
    self._logits = jax.jit(model_lib.forward, static_argnums=1)

  @classmethod
  def init(cls, cfg: model_lib.ModelConfig, seed: int = 0, mesh=None, **kwargs) -> "Policy":
    """Randomly initialised parameters, created directly in their shardings."""
    mesh = mesh if mesh is not None else sharding_lib.make_mesh({"data": -1},
                                                                jax.devices()[:1])
    params = sharding_lib.init_sharded(cfg, mesh, jax.random.key(seed))
    return cls(cfg, params, mesh, **kwargs)

  @classmethod
  def from_pretrained(cls, path: str, mesh=None, dtype: str = "float32") -> "Policy":
    """A Hugging Face folder (any architecture of model/families/: Qwen2, Qwen3, Qwen3-MoE,
    Llama 3.x, Gemma 3, and Gemma 3's text-and-vision folders' text model) or a jaxgrpo
    checkpoint folder, its tensors
    streamed onto `mesh` (default: one device). `policy.tokenizer` is its tokenizer; the
    pad and end-of-turn ids come from it."""
    from jaxgrpo.model import hf  # pylint: disable=g-import-not-at-top
    mesh = mesh if mesh is not None else sharding_lib.make_mesh({"data": -1},
                                                                jax.devices()[:1])
    if hf.is_hf_folder(path):
      cfg, params, tokenizer = hf.load_hf(path, dtype=dtype, mesh=mesh)
    else:
      cfg, params, tokenizer = hf.load_pretrained(path)
    policy = cls(cfg, params, mesh, pad_id=tokenizer.pad_id, eos_id=tokenizer.stop_ids)
    policy.tokenizer = tokenizer
    return policy

  @property
  def num_params(self) -> int:
    return model_lib.count_params(self.params)

  def logits(self, tokens_BxT, mask_BxT=None) -> jax.Array:
    """Teacher-forced next-token logits [B, T, V]; mask marks real (non-pad) tokens."""
    tokens = np.asarray(tokens_BxT, np.int32)
    mask = np.ones(tokens.shape, bool) if mask_BxT is None else np.asarray(mask_BxT, bool)
    return self._logits(self.params, self.cfg, tokens, mask)

  def generate(self, prompts: Sequence[Sequence[int]] | np.ndarray,
               sampling_params: sampling.SamplingParams, num_samples: int,
               max_new_tokens: int, seed: int, prompt_mask_BxL=None) -> sampling.Rollout:
    """Samples `num_samples` completions per prompt; rows are prompt-major.

    prompts: token-id lists of any lengths (left-padded here) or a [B, L] array with its
    mask. Returns a `sampling.Rollout` (tokens_NxT, logp_NxT, raw_logp_NxT, mask_NxT, ...).
    """
    tokens, mask = _as_batch(prompts, prompt_mask_BxL, self.pad_id)
    profile = sampling.Profile(sampling_params, num_samples, max_new_tokens)
    # The end ids are compiled in, so they are part of the key (eos_id may be reassigned).
    ends = None if self.eos_id is None else tuple(np.atleast_1d(self.eos_id).tolist())
    if (profile, ends, self.pad_id) not in self._samplers:
      self._samplers[(profile, ends, self.pad_id)] = sampling.compile_sampler(
          self.cfg, profile, eos_id=ends, pad_id=self.pad_id, mesh=self.mesh)
    rows = np.arange(tokens.shape[0], dtype=np.int32)
    return self._samplers[(profile, ends, self.pad_id)](self.params, tokens, mask,
                                                        jax.random.key(seed), rows)


  def score(self, prompts, completions, completion_mask_NxT=None, prompt_mask_BxL=None):
    """Teacher-forced log-probs of each completion's tokens after its prompt, under the raw
    model (temperature 1, no truncation: what generate's raw_logp_NxT holds for its own
    samples, and what the loss recomputes). Returns (logp_NxT float32, mask_NxT bool).

    prompts: as for `generate` (B of them); completions: N = B * G rows, prompt-major as
    generate returns them (G = N / B): token-id lists of any lengths, or an [N, T] array
    with `completion_mask_NxT` (e.g. generate's tokens_NxT and mask_NxT). Positions where
    the mask is False score 0.
    """
    tokens_BxL, mask_BxL = _as_batch(prompts, prompt_mask_BxL, self.pad_id)
    if isinstance(completions, np.ndarray) or hasattr(completions, "shape"):
      comp_NxT = np.asarray(completions, np.int32)
      comp_mask_NxT = (np.ones(comp_NxT.shape, bool) if completion_mask_NxT is None
                       else np.asarray(completion_mask_NxT, bool))
    else:
      rows = [list(map(int, c)) for c in completions]
      width = max(1, max(map(len, rows), default=1))
      comp_NxT = np.full((len(rows), width), self.pad_id, np.int32)
      comp_mask_NxT = np.zeros((len(rows), width), bool)
      for i, r in enumerate(rows):
        comp_NxT[i, :len(r)], comp_mask_NxT[i, :len(r)] = r, True
    n, b = len(comp_NxT), len(tokens_BxL)
    if not b or n % b:
      raise ValueError(f"completions: {n} rows for {b} prompts; expected G per prompt, "
                       "prompt-major (N = B * G)")
    g, width = n // b, tokens_BxL.shape[1]
    seq_NxS = np.concatenate([np.repeat(tokens_BxL, g, 0), comp_NxT], axis=1)
    seq_mask_NxS = np.concatenate([np.repeat(mask_BxL, g, 0), comp_mask_NxT], axis=1)
    logits = self._logits(self.params, self.cfg, seq_NxS, seq_mask_NxS)
    # The logits at position p predict the token at p + 1: the completion's tokens are
    # predicted from the prompt's last position on.
    logp_NxTxV = jax.nn.log_softmax(logits[:, width - 1:-1].astype(np.float32), axis=-1)
    logp_NxT = np.take_along_axis(np.asarray(logp_NxTxV), comp_NxT[..., None], -1)[..., 0]
    return np.where(comp_mask_NxT, logp_NxT, 0.0).astype(np.float32), comp_mask_NxT


def _as_batch(prompts, mask, pad_id):
  if isinstance(prompts, np.ndarray) or hasattr(prompts, "shape"):
    tokens = np.asarray(prompts, np.int32)
    if tokens.ndim != 2:
      raise ValueError(f"prompts: expected a [B, L] array, got shape {tokens.shape}")
    mask = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask, bool)
    return tokens, mask
  rows = [list(map(int, p)) for p in prompts]
  if not rows or any(not r for r in rows):
    raise ValueError("prompts: need at least one prompt, and no prompt may be empty")
  width = max(len(r) for r in rows)
  tokens = np.full((len(rows), width), pad_id, np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, r in enumerate(rows):
    tokens[i, width - len(r):] = r
    mask[i, width - len(r):] = True
  return tokens, mask
