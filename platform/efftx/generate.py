"""Generate text from an exported model (model.safetensors + config.json) with a KV cache.

    python -m efftx.generate --model PATH --prompt TEXT --max-new-tokens N [--temperature T]
                             [--top-k K] [--top-p P] [--seed S] [--weights float32|bfloat16]

A byte model reads and writes UTF-8 bytes; a token model (trained with ``data.tokenizer``) encodes the prompt and
decodes its tokens with the ``tokenizer.json`` its export carries. ``--max-new-tokens`` counts the model's tokens.
"""

from __future__ import annotations

import argparse
import sys

import torch

from efftx.errors import EfftxError, ExportError
from efftx.generation.compiled import COMPILE_CHOICES
from efftx.generation.decode import generate
from efftx.kernels.linear_cpu import WEIGHTS, use_weights


def sample_text(model_path: str, prompt: str, max_new_tokens: int, *, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0, seed: int | None = None, device: str = "cpu",
                compile: str = "off", weights: str = "float32") -> str:
    """``compile``: decode with compiled steps ("on" / "auto", :mod:`efftx.generation.compiled`) or eagerly;
    ``weights``: the Linear weights as loaded (``float32``) or in bfloat16 (a CPU decoding option,
    :func:`efftx.kernels.linear_cpu.bf16_weights`)."""
    from efftx.data.lm_tokenizer import export_codec
    from efftx.export import load_export, resolve_export

    if not prompt:
        raise ExportError("the prompt is empty")
    if max_new_tokens < 1:
        raise ExportError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ExportError("temperature must be >= 0, top_k >= 0 and top_p in (0, 1]")
    if weights not in WEIGHTS:
        raise ExportError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "bfloat16" and not str(device).startswith("cpu"):
        raise ExportError(f"--weights bfloat16 is a CPU decoding option; got --device {device}")
    folder = resolve_export(model_path)
    model, cfg, _ = load_export(folder, device)
    use_weights(model, weights)
    codec = export_codec(folder, cfg)
    tokens = codec.encode(prompt)
    if not tokens:
        raise ExportError(f"the prompt {prompt!r} encodes to no tokens with {codec.source}")
    if len(tokens) + max_new_tokens > model.max_seq_len:
        raise ExportError(f"prompt ({len(tokens)} {codec.unit}) + max_new_tokens ({max_new_tokens}) exceeds the "
                          f"model's max_seq_len={model.max_seq_len}")
    prompt_t = torch.tensor([tokens], dtype=torch.long, device=device)
    out = generate(model, prompt_t, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   compile=compile)
    return codec.continuation(tokens, out[0].tolist())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", required=True, help="export folder (model.safetensors + config.json)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", choices=COMPILE_CHOICES, default=None,
                   help="compiled decoding steps (CUDA graphs on a GPU): 'auto' (the default on cuda) compiles where "
                        "the model allows and says why not otherwise, 'on' insists, 'off' (the default on cpu, where "
                        "compiling takes longer than a short sample) decodes eagerly")
    p.add_argument("--weights", choices=WEIGHTS, default="float32",
                   help="the Linear weights as decoding holds them: 'float32' (as exported) or 'bfloat16' (CPU only, "
                        "weight-only: half the memory and bytes read per step; outputs follow the rounded weights)")
    args = p.parse_args(argv)
    if args.compile is None:
        args.compile = "auto" if args.device.startswith("cuda") else "off"
    try:
        text = sample_text(args.model, args.prompt, args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, device=args.device,
                           compile=args.compile, weights=args.weights)
    except EfftxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(args.prompt + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
