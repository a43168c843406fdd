"""Named run configs. ``get(name)`` returns a fresh :class:`Config`; ``--set`` overrides apply on top.

``*_debug`` recipes are tiny: they train in seconds on a CPU and are what the tests run.
"""

from __future__ import annotations

import difflib
from typing import Callable

from efftx.config import Config
from efftx.errors import ConfigError

_RECIPES: dict[str, Callable[[], Config]] = {}


def recipe(fn: Callable[[], Config]) -> Callable[[], Config]:
    _RECIPES[fn.__name__] = fn
    return fn


def names() -> list[str]:
    return sorted(_RECIPES)


def get(name: str) -> Config:
    if name not in _RECIPES:
        close = difflib.get_close_matches(name, names(), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown recipe {name!r}{hint}; available: {', '.join(names())}")
    cfg = _RECIPES[name]()
    cfg.recipe = name
    return cfg


# Training settings shared by every *_debug recipe: a 2-worker run of 40 steps, seconds on a CPU.
_DEBUG_TRAIN = {
    "model.max_seq_len": 128, "data.seq_len": 64,
    "train.steps": 40, "train.micro_batch_size": 4, "train.grad_accum": 2, "train.lr": 3e-3,
    "train.warmup_steps": 5, "train.log_every": 5, "train.eval_every": 20, "train.eval_batches": 4,
    "train.sample_every": 0, "train.sample_prompt_len": 32, "train.sample_length": 48,
    "train.checkpoint_every": 20,
    "scaling.cpus_per_worker": 0.5,
}

# Settings shared by the *_small recipes: a few minutes on a 2-core CPU, on the bundled corpus.
_SMALL_TRAIN = {
    "data.seq_len": 128,
    "train.steps": 300, "train.micro_batch_size": 16, "train.grad_accum": 1, "train.lr": 2e-3,
    "train.warmup_steps": 30, "train.log_every": 20, "train.eval_every": 50, "train.eval_batches": 8,
    "train.sample_every": 150, "train.sample_prompt_len": 64, "train.sample_length": 128,
    "train.checkpoint_every": 100,
}

# The seeds' enwik8 scripts: validate every 100 steps, sample every 500, 100k steps, Adam 2e-4 with
# warmup, clipping 0.5. Their DeepSpeed JSON is not in the seeds: the batch is the scripts' argparse
# default (32 sequences per optimizer step) with accumulation 4 (their printed loss is loss x 4),
# i.e. 4 per worker x 4 micro batches x 2 workers.
_ENWIK8_TRAIN = {
    "data.corpus": "data/enwik8.gz",
    "train.steps": 100_000, "train.micro_batch_size": 4, "train.grad_accum": 4, "train.lr": 2e-4,
    "train.warmup_steps": 1000, "train.grad_clip": 0.5, "train.log_every": 10, "train.eval_every": 100,
    "train.eval_batches": 16, "train.sample_every": 500, "train.sample_prompt_len": 128,
    "train.checkpoint_every": 1000, "engine.precision": "auto",
}


@recipe
def lm_debug() -> Config:
    """2-layer byte LM with GQA: a full 2-worker DeepSpeed run in well under a minute on CPU."""
    return Config().override({
        "model.dim": 64, "model.depth": 2, "model.heads": 4, "model.kv_heads": 2, **_DEBUG_TRAIN,
    })


@recipe
def lm_small() -> Config:
    """A 4-layer byte LM with full attention on the bundled corpus."""
    return Config().override({
        "model.dim": 192, "model.depth": 4, "model.heads": 6, "model.kv_heads": 2, "model.max_seq_len": 256,
        **_SMALL_TRAIN,
    })


@recipe
def lm_enwik8() -> Config:
    """An 8-layer, 512-wide byte LM with full attention on enwik8 (--set data.corpus=PATH/enwik8.gz)."""
    return Config().override({
        "model.dim": 512, "model.depth": 8, "model.heads": 8, "model.max_seq_len": 1024,
        "data.seq_len": 1024, **_ENWIK8_TRAIN, "train.sample_length": 512,
    })


# ------------------------------------------------------------------------------------------ Sinkhorn

_SINKHORN_MODEL = {  # the seed: SinkhornTransformerLM(emb_dim=128, dim=512, depth=8, heads=8, ...)
    "model.dim": 512, "model.emb_dim": 128, "model.depth": 8, "model.heads": 8, "model.reversible": True,
    "model.ff_chunks": 10, "attention.kind": "sinkhorn", "attention.dropout": 0.1,
    "attention.sinkhorn.bucket_size": 128, "attention.sinkhorn.n_local_attn_heads": 4,
}


@recipe
def sinkhorn_enwik8() -> Config:
    """The Sinkhorn seed on enwik8: 8 layers, 512 wide, 4096 tokens, buckets of 128, 4 local heads."""
    return Config().override({**_SINKHORN_MODEL, "model.max_seq_len": 4096, "data.seq_len": 4096,
                              **_ENWIK8_TRAIN, "train.sample_length": 1024})


@recipe
def sinkhorn_small() -> Config:
    """The Sinkhorn architecture, shrunk to train in minutes on a CPU on the bundled corpus."""
    return Config().override({
        **_SINKHORN_MODEL, "model.dim": 192, "model.emb_dim": 64, "model.depth": 4, "model.heads": 6,
        "model.max_seq_len": 256, "model.ff_chunks": 2, "attention.sinkhorn.bucket_size": 32,
        "attention.sinkhorn.n_local_attn_heads": 2, **_SMALL_TRAIN,
    })


@recipe
def sinkhorn_debug() -> Config:
    return Config().override({
        **_SINKHORN_MODEL, "model.dim": 64, "model.emb_dim": 32, "model.depth": 2, "model.heads": 4,
        "model.ff_chunks": 2, "attention.sinkhorn.bucket_size": 16, "attention.sinkhorn.n_local_attn_heads": 2,
        **_DEBUG_TRAIN,
    })


# ------------------------------------------------------------------------------------------ Performer

_PERFORMER_MODEL = {  # the seed: PerformerLM(dim=512, depth=6, heads=8, nb_features=256, reversible, scalenorm)
    "model.dim": 512, "model.depth": 6, "model.heads": 8, "model.reversible": True, "model.norm": "scalenorm",
    "attention.kind": "performer", "attention.performer.nb_features": 256,
}


@recipe
def performer_enwik8() -> Config:
    """The Performer seed on enwik8: 6 layers, 512 wide, 1024 tokens, 256 random features."""
    return Config().override({**_PERFORMER_MODEL, "model.max_seq_len": 1024, "data.seq_len": 1024,
                              **_ENWIK8_TRAIN, "train.sample_length": 512})


@recipe
def performer_small() -> Config:
    """The Performer architecture, shrunk to train in minutes on a CPU on the bundled corpus."""
    return Config().override({
        **_PERFORMER_MODEL, "model.dim": 192, "model.depth": 4, "model.heads": 6, "model.max_seq_len": 256,
        "attention.performer.nb_features": 64, "attention.performer.chunk_size": 32, **_SMALL_TRAIN,
    })


@recipe
def performer_debug() -> Config:
    return Config().override({
        **_PERFORMER_MODEL, "model.dim": 64, "model.depth": 2, "model.heads": 4,
        "attention.performer.nb_features": 32, "attention.performer.chunk_size": 16,
        "attention.performer.feature_redraw_interval": 10, **_DEBUG_TRAIN,
    })


# ------------------------------------------------------------------------------------------ NSA
# The native-sparse-attention seed: Transformer(num_tokens=256, dim=512, depth=6, heads=8, dim_head=64,
# kv_heads=4), sliding window 64, compressed blocks of 16 (GroupedMLP compression), selection blocks of 16,
# 4 selected; untied logits; Adam 1e-4 (no warmup, no decay, default betas), batch 4 x accumulation 4 on one
# GPU, clip 0.5, seq 512, validate every 100, sample 512 bytes after a 64-byte prime every 500. One worker
# keeps the seed's 16 sequences per step (--workers N multiplies it). nsa_full_<size> is the same model with
# full (SDPA) attention, the baseline. Recipes nsa_<size> / nsa_full_<size> come from this table.

# The seed's NSA switches (every nsa_* size): QUERY_HEADS_SHARE_SELECTION=True -> share_selection, USE_DIFF_TOPK=True
# -> diff_topk, INTERPOLATED_IMPORTANCE_SCORE=False -> score_mapping=overlap (the seed's repeat-then-mean mapping;
# with l = l' = d = 16 every mapping is the identity), no forced initial block and the own (diagonal) block only.
# Its library's (native_sparse_attention_pytorch) own defaults: one learned memory key/value slot in the compressed
# branch (num_compressed_mem_kv=1), blocks ranked by a softmax of the group-mean compressed logits, selected blocks of
# importance below 1e-10 masked, use_diff_topk's gate on the selected keys, one k/v projection for the three branches.
_NSA_ARCH = {"model.tie_embeddings": False, "attention.kind": "nsa", "attention.nsa.compress_stride": 0,
             "attention.nsa.share_selection": True, "attention.nsa.diff_topk": True,
             "attention.nsa.score_mapping": "overlap", "attention.nsa.num_initial_blocks": 0,
             "attention.nsa.num_local_blocks": 1, "attention.nsa.compress_mem_kv": 1,
             "attention.nsa.importance": "logits_softmax", "attention.nsa.min_importance": 1e-10,
             "attention.nsa.diff_topk_gate": "keys", "attention.nsa.separate_kv": False}
_NSA_SIZES = {
    "enwik8": {
        "model.dim": 512, "model.depth": 6, "model.heads": 8, "model.kv_heads": 4, "model.head_dim": 64,
        "model.max_seq_len": 1024, "data.seq_len": 512,
        "attention.nsa.compress_block_size": 16, "attention.nsa.selection_block_size": 16,
        "attention.nsa.num_selected_blocks": 4, "attention.nsa.sliding_window_size": 64,
        "attention.nsa.compress_mlp_mult": 1.0,
        **_ENWIK8_TRAIN, "train.lr": 1e-4, "train.warmup_steps": 0, "train.min_lr_ratio": 1.0,
        "train.weight_decay": 0.0, "train.beta2": 0.999, "train.sample_prompt_len": 64, "train.sample_length": 512,
        "scaling.num_workers": 1,
    },
    "small": {
        "model.dim": 192, "model.depth": 4, "model.heads": 6, "model.kv_heads": 2, "model.head_dim": 32,
        "model.max_seq_len": 256, "attention.nsa.compress_block_size": 16, "attention.nsa.compress_stride": 8,
        "attention.nsa.selection_block_size": 16, "attention.nsa.num_selected_blocks": 2,
        "attention.nsa.sliding_window_size": 32, "attention.nsa.compress_mlp_mult": 0.25, **_SMALL_TRAIN,
    },
    "debug": {
        "model.dim": 64, "model.depth": 2, "model.heads": 4, "model.kv_heads": 2, "model.head_dim": 16,
        "attention.nsa.compress_block_size": 8, "attention.nsa.selection_block_size": 8,
        "attention.nsa.num_selected_blocks": 2, "attention.nsa.sliding_window_size": 16,
        "attention.nsa.compress_mlp_mult": 0.5, **_DEBUG_TRAIN,
    },
}
for _size, _settings in _NSA_SIZES.items():
    _RECIPES[f"nsa_{_size}"] = lambda settings=_settings: Config().override({**_NSA_ARCH, **settings})
    _RECIPES[f"nsa_full_{_size}"] = lambda settings=_settings: Config().override(
        {**_NSA_ARCH, **settings, "attention.kind": "full"})


# ------------------------------------------------------------------------------------------ speculative pair
# The speculative-decoding seed: Decoder(num_tokens=256, dim=512, depth=10) as target and depth 2 as draft,
# batch 4 x accumulation 4, Adam 1e-4, clip 0.5, seq 512, validate every 100, sample every 500 (prime 128,
# 512 generated), gamma 5. jobs/train_speculative.py trains the draft, then the target with
# speculative.draft pointing at the draft's export, so every sample compares base and speculative decoding.
# With --distill it trains the target first and the draft on the target's distribution (distill.teacher =
# the target's export: KL to its logits on the same batches, DistillSpec), which raises acceptance.

_SPEC = {
    "model.dim": 512, "model.heads": 8, "model.max_seq_len": 1024, "data.seq_len": 512,
    "data.corpus": "data/enwik8.gz", "train.steps": 100_000, "train.micro_batch_size": 2, "train.grad_accum": 4,
    "train.lr": 1e-4, "train.warmup_steps": 0, "train.min_lr_ratio": 1.0, "train.grad_clip": 0.5,
    "train.log_every": 10, "train.eval_every": 100, "train.eval_batches": 16, "train.sample_every": 500,
    "train.sample_prompt_len": 128, "train.sample_length": 512, "train.checkpoint_every": 1000,
    "speculative.gamma": 5,
}
_SPEC_SMALL = {"model.dim": 192, "model.heads": 6, "model.max_seq_len": 256, **_SMALL_TRAIN,
               "train.sample_prompt_len": 32, "train.sample_length": 96}
_SPEC_DEBUG = {"model.dim": 64, "model.heads": 4, "model.kv_heads": 2, **_DEBUG_TRAIN, "train.sample_every": 20,
               "train.sample_length": 24}


# (size -> settings, target depth, draft depth): recipes spec_target_<size> and spec_draft_<size>
_SPEC_PAIRS = {"enwik8": (_SPEC, 10, 2), "small": (_SPEC_SMALL, 6, 1), "debug": (_SPEC_DEBUG, 3, 1)}
for _size, (_settings, _target_depth, _draft_depth) in _SPEC_PAIRS.items():
    for _role, _depth in (("target", _target_depth), ("draft", _draft_depth)):
        _RECIPES[f"spec_{_role}_{_size}"] = (
            lambda settings=_settings, depth=_depth: Config().override({**settings, "model.depth": depth}))


# ------------------------------------------------------------------------------------------ dVAE + DALL-E
# The DALL-E seed (train_dalle.py): DALLE(dim=512, depth=2, heads=8, dim_head=64, text_seq_len=256,
# loss_img_weight=7, attn_types=full; no rotary, token shift, sharing, reversible or dropout: its flags'
# defaults), Adam 3e-4 held constant (ReduceLROnPlateau only with --lr_decay: train.schedule=plateau), clip
# 0.5, batch 4 (DeepSpeed's train_batch_size: 2 per worker x 2 workers), fp32 (--fp16: engine.precision=fp16),
# an image generated every 100 steps with filter_thres 0.9, a checkpoint every 1000 steps. Its 20 epochs are
# ~10k steps on the default data (2048 synthetic shapes at batch 4). The dVAE is the original train_vae.py's:
# the VAEConfig defaults, batch 8, Adam 1e-3 decayed x0.98 per epoch for 20 epochs (here a cosine from 1e-3
# to 0.67e-3 = 0.98**20 over the run), 4 reconstructions every 100 steps. The recipes come in pairs
# dvae<size> / dalle<size> (the dalle one carries the same vae.*, replaced at launch by its dVAE export's);
# jobs/train_dalle.py trains the pair's dVAE first when it is given none. docs/dalle.md maps every seed flag.

_ADAM = {"train.weight_decay": 0.0, "train.beta2": 0.999, "train.warmup_steps": 0}  # the seeds' plain Adam
_DALLE_MODEL = {
    "model.family": "dalle", "model.dim": 512, "model.depth": 2, "model.heads": 8, "model.head_dim": 64,
    "model.rotary": False, "model.tie_embeddings": False, "model.norm": "layernorm",
    "dalle.text_seq_len": 256, "dalle.loss_img_weight": 7.0, "dalle.attn_types": "full",
}
_IMAGE_PAIRS = {  # size suffix -> (data + vae settings shared by the pair, dVAE settings, DALL-E settings)
    "": (
        {"data.image.shapes_size": 128, "engine.precision": "fp32"},
        {**_ADAM, "train.steps": 5_000, "train.micro_batch_size": 4, "train.lr": 1e-3, "train.min_lr_ratio": 0.67,
         "train.grad_clip": 0.0, "train.log_every": 10, "train.eval_every": 500, "train.eval_batches": 16,
         "train.sample_every": 100, "data.image.sample_images": 4, "train.checkpoint_every": 1000},
        {**_DALLE_MODEL, **_ADAM, "train.steps": 10_000, "train.micro_batch_size": 2, "train.lr": 3e-4,
         "train.min_lr_ratio": 1.0, "train.grad_clip": 0.5, "train.log_every": 10, "train.eval_every": 500,
         "train.eval_batches": 16, "train.sample_every": 100, "data.image.sample_images": 4,
         "dalle.sample_filter_thres": 0.9, "train.sample_temperature": 1.0, "train.checkpoint_every": 1000},
    ),
    # A CPU demo in minutes that learns shape and background colours: 32x32 images, an 8x8 grid of 128 codes.
    "_shapes_small": (
        {"data.image.shapes_size": 32, "data.image.shapes_n": 2048, "vae.image_size": 32, "vae.num_layers": 2,
         "vae.hidden_dim": 64, "vae.num_resnet_blocks": 1, "vae.num_tokens": 128, "vae.codebook_dim": 64,
         "vae.temperature_anneal": 0.004},
        {**_SMALL_TRAIN, **_ADAM, "train.sample_every": 100, "data.image.sample_images": 8},
        {**_DALLE_MODEL, **_SMALL_TRAIN, **_ADAM, "model.dim": 128, "model.depth": 4, "model.heads": 4,
         "model.head_dim": 32, "dalle.text_seq_len": 64, "dalle.attn_types": "full,axial_row,axial_col,conv_like",
         "train.steps": 600, "train.lr": 1e-3, "train.min_lr_ratio": 0.1, "train.warmup_steps": 30,
         "train.sample_every": 200, "data.image.sample_images": 8, "dalle.sample_filter_thres": 0.9,
         "train.sample_temperature": 1.0},
    ),
    # CI: 2 workers, 40 steps, seconds each. 32x32 images, an 8x8 grid of 64 codes; captions fit 64 bytes.
    "_shapes_debug": (
        {"data.image.shapes_size": 32, "data.image.shapes_n": 256, "vae.image_size": 32, "vae.num_layers": 2,
         "vae.hidden_dim": 32, "vae.num_resnet_blocks": 1, "vae.num_tokens": 64, "vae.codebook_dim": 32,
         "vae.temperature_anneal": 0.02},
        {**_DEBUG_TRAIN, "train.weight_decay": 0.0},
        {**_DALLE_MODEL, **_DEBUG_TRAIN, "model.dim": 64, "model.depth": 2, "model.heads": 4, "model.head_dim": 16,
         "dalle.text_seq_len": 64, "dalle.attn_types": "full,axial_row", "train.weight_decay": 0.0,
         "train.sample_temperature": 1.0},
    ),
}
_PAIRS: dict[str, str] = {}  # DALL-E recipe -> its dVAE recipe
for _size, (_shared, _dvae, _dalle) in _IMAGE_PAIRS.items():
    _PAIRS[f"dalle{_size}"] = f"dvae{_size}"
    _RECIPES[f"dvae{_size}"] = lambda shared=_shared, own=_dvae: Config().override(
        {"model.family": "dvae", **shared, **own})
    _RECIPES[f"dalle{_size}"] = lambda shared=_shared, own=_dalle: Config().override({**shared, **own})


def pairs() -> dict[str, str]:
    """DALL-E recipe -> the dVAE recipe trained first when it is given no dVAE (declared with the recipes)."""
    return dict(_PAIRS)


_JOBS = {"sinkhorn": "train_sinkhorn.py", "performer": "train_performer.py", "nsa": "train_nsa.py"}  # else train_lm.py


def train_command(name: str) -> str | None:
    """The job command that trains (and registers, under this name) the recipe ``name``; None for a name that is
    no recipe (a model registered under a tracking.model_name of its own)."""
    spec = name.removeprefix("spec_target_").removeprefix("spec_draft_")
    if spec != name and spec in _SPEC_PAIRS:
        return f"python jobs/train_speculative.py --size {spec}"
    if name not in _RECIPES:
        return None
    if name in _PAIRS:
        return f"python jobs/train_dalle.py --recipe {name}"
    if name in _PAIRS.values():
        return f"python jobs/train_vae.py --recipe {name}"
    return f"python jobs/{_JOBS.get(get(name).attention.kind, 'train_lm.py')} --recipe {name}"


def paired_dvae(dalle_recipe: str) -> str:
    """The dVAE recipe of a DALL-E recipe's pair (dalle_shapes_debug -> dvae_shapes_debug)."""
    if dalle_recipe not in _PAIRS:
        raise ConfigError(f"no dVAE recipe pairs with {dalle_recipe!r}: give a trained dVAE (--vae) or name its "
                          f"recipe (--vae-recipe, one of {', '.join(sorted(set(_PAIRS.values())))})")
    return _PAIRS[dalle_recipe]
