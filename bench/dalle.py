"""DALL-E at the issue's benchmark scale: training speed and memory, cached vs uncached generation, Serve load.

    python bench/dalle.py [--quick] [--device cpu|cuda] [--threads N] [--batch B] [--steps N] [--images N]
                          [--repeats N] [--serve-url http://127.0.0.1:8000] [--serve-requests N] [--serve-n N]

Scale (the issue's): a dVAE of 64x64 RGB images with 2 stride-2 downsamplings (a 16x16 grid: 256 image
tokens), 512 codes of dim 256 (recipe ``dvae`` + those keys; its hidden dim 256 and 2 resnet blocks are
the original train_vae.py's); a DALL-E of dim 256, depth 2, 4 heads of 64, text_seq_len 32, full
attention (recipe ``dalle`` + those keys; byte captions: vocabulary 257). Random initialisation: speed
and memory do not depend on the weights' values.

1. **Training**, model level (no Ray, no DeepSpeed): forward + backward + AdamW, batch --batch, the
   median of --steps steps after 2 warm-up steps. dVAE: random images at the Gumbel temperature of step 0;
   its tokens/s counts the 256 codes of each image (the train loop logs a dVAE image as one "token": its
   images/s is printed too). DALL-E: a caption and random images, encoded by the frozen dVAE inside the
   step as in training; tokens/s = batch x (32 + 256) / step time, the train loop's count. GFLOP/s: the
   models' ``flops_per_token`` x tokens (per image for the dVAE).
2. **Generation**: ``generate_image_tokens`` of one caption x --images images (256 tokens each;
   filter_thres 0.9, temperature 1, seed 0) with the KV cache and without it (every step recomputes the
   whole sequence), at cond_scale 1 and 3 (3 runs a doubled batch: conditional and null rows). Image
   tokens/s counts the returned images' tokens; the median of --repeats runs after a warm-up forward.
   "cached/uncached" is the speed-up at the same cond_scale (the issue aims for >= 10x); "same tokens"
   says whether both paths drew the same codes from the same seed.
3. **Serve** (``--serve-url`` of a running app, e.g. ``serve run`` of the project's config): images/s of
   ``POST /images/generate`` (``{prompt, n, seed}``) at 1 and 8 concurrent clients, --serve-requests
   requests each, after one warm-up request. Skipped, with a note, without a URL.

Each measurement of 1 and 2 runs in a fresh subprocess, so its peak memory is its own: on CUDA the
allocator's peak (``torch.cuda.max_memory_allocated``), on CPU the peak RSS above the RSS before the
model was built (``ru_maxrss``); both include the weights. CUDA trains under bf16 autocast; CPU and all
generation run in float32. Torch threads (--threads) are set in every subprocess and printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time

VAE = {"vae.image_size": 64, "vae.num_layers": 2, "vae.num_tokens": 512, "vae.codebook_dim": 256}
DALLE = {"model.dim": 256, "model.depth": 2, "model.heads": 4, "model.head_dim": 64, "dalle.text_seq_len": 32}
CAPTION = "a red circle in the center"  # byte tokens, fits text_seq_len 32
COND_SCALES = (1.0, 3.0)


def configs():
    """(dVAE config, DALL-E config) at the benchmark scale, from the recipes + the keys above."""
    from efftx import recipes
    from efftx.data.text_tokens import ByteTokenizer

    vae_cfg = recipes.get("dvae").override(VAE)
    cfg = recipes.get("dalle").override({**VAE, **DALLE, "model.vocab_size": ByteTokenizer.vocab_size})
    for c in (vae_cfg, cfg):
        c.name = "bench"
        c.validate()
    return vae_cfg, cfg


class Meter:
    """Peak memory of this process from now on: the CUDA allocator's peak, or the peak RSS above now."""

    def __init__(self, device: str):
        import torch

        self.device = device
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            import psutil

            self.base = psutil.Process().memory_info().rss

    def peak_mb(self) -> float:
        import resource

        import torch

        if self.device == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base, 0) / 2**20


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _caption(batch: int, text_seq_len: int):
    from efftx.data.text_tokens import ByteTokenizer, tokenize_batch

    return tokenize_batch(ByteTokenizer(), [CAPTION] * batch, text_seq_len)


def measure_train(which: str, device: str, batch: int, steps: int) -> dict:
    """One model's training step: median seconds, images/s, tokens/s, GFLOP/s, peak MiB."""
    import torch

    from efftx import models
    from efftx.models.dvae import DiscreteVAE
    from efftx.train.engine import param_groups

    vae_cfg, cfg = configs()
    run_cfg = vae_cfg if which == "dvae" else cfg
    meter = Meter(device)
    torch.manual_seed(0)
    model = (DiscreteVAE(vae_cfg.vae) if which == "dvae" else models.build(cfg)).to(device).train()
    t = run_cfg.train
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2))
    images = torch.rand(batch, 3, 64, 64, device=device)
    text = _caption(batch, cfg.dalle.text_seq_len).to(device)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss, _ = model(images) if which == "dvae" else model(text, images)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    _sync(device)
    seconds = _median_time(step, device, steps)
    grid = vae_cfg.vae.image_seq_len
    per_image = grid if which == "dvae" else cfg.dalle.text_seq_len + grid
    flops_per_image = model.flops_per_token() * (1 if which == "dvae" else per_image)
    return {"step_s": seconds, "images_per_s": batch / seconds, "tokens_per_s": batch * per_image / seconds,
            "gflops": flops_per_image * batch / seconds / 1e9, "peak_mb": meter.peak_mb(),
            "params": model.num_params()}


def measure_generate(device: str, images: int, cond_scale: float, use_cache: bool, repeats: int) -> dict:
    """Generation of ``images`` images of one caption: median seconds, image tokens/s, peak MiB, codes digest."""
    import torch

    from efftx.generation.images import generate_image_tokens
    from efftx import models

    _, cfg = configs()
    meter = Meter(device)
    torch.manual_seed(0)
    model = models.build(cfg).to(device).eval()
    text = _caption(1, cfg.dalle.text_seq_len).to(device)
    with torch.no_grad():  # warm-up: one forward over the whole sequence (kernels, allocator)
        rows = images * (2 if cond_scale != 1 else 1)
        model.hidden(torch.zeros(rows, model.seq_len, dtype=torch.long, device=device))
    codes = []

    def run():
        codes.append(generate_image_tokens(model, text, num_images=images, filter_thres=0.9, temperature=1.0,
                                           cond_scale=cond_scale, seed=0, use_cache=use_cache))

    seconds = _median_time(run, device, repeats)
    digest = hashlib.sha1(codes[0].cpu().numpy().tobytes()).hexdigest()[:12]
    return {"seconds": seconds, "tokens_per_s": images * model.image_seq_len / seconds, "peak_mb": meter.peak_mb(),
            "codes": digest, "image_tokens": model.image_seq_len}


MEASURES = {"train": measure_train, "generate": measure_generate}


def point(what: str, *args, threads: int) -> dict:
    """``MEASURES[what](*args)`` in a fresh subprocess with ``threads`` torch threads; {"error": line} if it fails."""
    proc = subprocess.run([sys.executable, __file__, "--threads", str(threads), "--point", json.dumps([what, *args])],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no output"]
        return {"error": lines[-1][:80]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  measured {what} {args}: {result}", file=sys.stderr, flush=True)
    return result


def _cell(r: dict, key: str, fmt: str = "{:,.1f}", scale: float = 1.0) -> str:
    return fmt.format(r[key] * scale) if key in r else r.get("error", "-")[:30]


def train_table(args) -> None:
    rows = {name: point("train", which, args.device, args.batch, args.steps, threads=args.threads)
            for name, which in (("dVAE", "dvae"), ("DALL-E", "dalle"))}
    precision = "bf16 autocast" if args.device == "cuda" else "float32"
    print(f"\ntraining step (forward + backward + AdamW), batch {args.batch}, median of {args.steps} steps, "
          f"{precision}, model level (no Ray / DeepSpeed)")
    print(f"{'model':<8}{'params':>11}{'step ms':>10}{'images/s':>10}{'tokens/s':>11}{'GFLOP/s':>9}{'peak MiB':>10}")
    for name, r in rows.items():
        print(f"{name:<8}{_cell(r, 'params', '{:,}'):>11}{_cell(r, 'step_s', '{:.1f}', 1e3):>10}"
              f"{_cell(r, 'images_per_s'):>10}{_cell(r, 'tokens_per_s', '{:,.0f}'):>11}{_cell(r, 'gflops'):>9}"
              f"{_cell(r, 'peak_mb'):>10}")
    print("tokens: dVAE = 256 codes per image; DALL-E = 32 text + 256 image tokens per sample")


def generation_table(args) -> None:
    rows = {(s, c): point("generate", args.device, args.images, s, c, args.repeats, threads=args.threads)
            for s in COND_SCALES for c in (True, False)}
    print(f"\ngeneration: 1 caption x {args.images} images x 256 image tokens, filter_thres 0.9, seed 0, float32, "
          f"median of {args.repeats}")
    print(f"{'cond_scale':>10}  {'cache':<6}{'seconds':>9}{'image tok/s':>13}{'cached/uncached':>17}"
          f"{'peak MiB':>10}  same tokens")
    for s in COND_SCALES:
        on, off = rows[s, True], rows[s, False]
        both = "tokens_per_s" in on and "tokens_per_s" in off
        ratio = f"{on['tokens_per_s'] / off['tokens_per_s']:.1f}x" if both else "-"
        same = ("yes" if on["codes"] == off["codes"] else "NO") if "codes" in on and "codes" in off else "-"
        for label, r in (("on", on), ("off", off)):
            print(f"{s:>10g}  {label:<6}{_cell(r, 'seconds', '{:.2f}'):>9}{_cell(r, 'tokens_per_s', '{:,.0f}'):>13}"
                  f"{ratio if label == 'on' else '':>17}{_cell(r, 'peak_mb'):>10}  {same if label == 'on' else ''}")


def serve_table(args) -> None:
    """images/s of POST /images/generate at 1 and 8 clients (the load loop of bench/serve_load.py)."""
    if not args.serve_url:
        print("\nServe endpoint: skipped (no --serve-url; start the app, e.g. `serve run` of the project's config, "
              "and pass its base URL)")
        return
    import requests

    from serve_load import load  # bench/serve_load.py, beside this script

    url = args.serve_url.rstrip("/")
    if not url.endswith("/images/generate"):
        url += "/images/generate"
    body = {"prompt": CAPTION, "n": args.serve_n, "seed": 0}
    try:
        warm = requests.post(url, json=body, timeout=args.serve_timeout)
    except requests.RequestException as exc:
        print(f"\nServe endpoint: skipped, {url} is not answering: {exc}")
        return
    if warm.status_code != 200:
        print(f"\nServe endpoint: skipped, the warm-up request got HTTP {warm.status_code}: {warm.text[:200]}")
        return
    results = {c: load(url, c, args.serve_requests, body, args.serve_timeout) for c in (1, 8)}
    print(f"\nServe POST {url}: {args.serve_requests} requests of n={args.serve_n} per level, prompt {CAPTION!r}")
    print(f"{'clients':>7}{'ok':>5}{'errors':>8}{'images/s':>10}{'vs 1 client':>13}{'p50 ms':>9}{'p99 ms':>9}")
    base = results[1]["rps"] * args.serve_n
    for c, r in results.items():
        ips = r["rps"] * args.serve_n
        vs = f"{ips / base:.2f}x" if base > 0 else "-"
        print(f"{c:>7}{r['ok']:>5}{r['errors']:>8}{ips:>10.2f}{vs:>13}{r['p50']:>9.0f}{r['p99']:>9.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: batch 2, 2 steps, 1 image, 1 repeat, 4 requests")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own count)")
    p.add_argument("--batch", type=int, default=4, help="training batch")
    p.add_argument("--steps", type=int, default=10, help="timed training steps")
    p.add_argument("--images", type=int, default=4, help="images generated at once")
    p.add_argument("--repeats", type=int, default=3, help="timed generations per point")
    p.add_argument("--serve-url", default="", help="base URL of a running app serving POST /images/generate")
    p.add_argument("--serve-requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--serve-n", type=int, default=1, help="images per request")
    p.add_argument("--serve-timeout", type=float, default=300.0, help="seconds per level (and per request)")
    p.add_argument("--point", help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch

    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    if args.point:
        what, *rest = json.loads(args.point)
        print(json.dumps(MEASURES[what](*rest)))
        return
    if args.quick:
        args.batch, args.steps, args.images, args.repeats, args.serve_requests = 2, 2, 1, 1, 4
    for name in ("batch", "steps", "images", "repeats", "serve_requests", "serve_n"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        p.error(f"--device must be cpu, or cuda on a machine with a CUDA device; got {args.device!r}")

    print(f"DALL-E benchmark: device {args.device}, {args.threads} torch threads{' (--quick)' if args.quick else ''}")
    print("dVAE 64x64 RGB, 2 downsamplings -> 16x16 = 256 codes of 512 (codebook dim 256); "
          "DALL-E dim 256, depth 2, 4 heads, text_seq_len 32 + 256 image tokens, full attention")
    train_table(args)
    generation_table(args)
    serve_table(args)


if __name__ == "__main__":
    main()
