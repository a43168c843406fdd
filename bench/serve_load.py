"""Load on the text app over loopback: requests/s and latency with @serve.batch on and off.

    python bench/serve_load.py [--clients 8] [--requests 64] [--max-new-tokens 16] [--mode base]

Starts a local Ray cluster and Serve on 127.0.0.1, deploys the text app with randomly initialised
spec_*_debug models (the load, not the text, is measured) twice: max_batch_size 8 (batching on) and 1
(off). Each time N client threads send a bounded number of POST /generate requests (each thread stops
after --timeout seconds at the latest). Prints requests/s, p50/p99 latency and errors side by side.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time

import requests
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(url: str, clients: int, total: int, body: dict, timeout: float) -> dict:
    latencies, errors, lock = [], [0], threading.Lock()
    remaining = [total]
    deadline = time.perf_counter() + timeout

    def client():
        while time.perf_counter() < deadline:
            with lock:
                if remaining[0] == 0:
                    return
                remaining[0] -= 1
            t0 = time.perf_counter()
            try:
                ok = requests.post(url, json=body, timeout=timeout).status_code == 200
            except requests.RequestException:
                ok = False
            with lock:
                (latencies.append(time.perf_counter() - t0) if ok else errors.__setitem__(0, errors[0] + 1))

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    lat = sorted(latencies)
    pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3) if lat else (lambda q: float("nan"))
    return {"ok": len(lat), "errors": errors[0], "rps": len(lat) / wall, "p50": pct(0.5), "p99": pct(0.99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--mode", default="base", choices=["base", "speculative", "both"])
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()

    import ray
    from ray import serve

    from efftx import recipes
    from efftx.models.lm import LM
    from efftx.serving.text import build
    from efftx.train.checkpoint import export

    root = tempfile.mkdtemp(prefix="efftx-serve-load-")
    paths = {}
    for role, seed in (("target", 0), ("draft", 1)):
        cfg = recipes.get(f"spec_{role}_debug")
        torch.manual_seed(seed)
        paths[role] = str(export(LM(cfg), cfg, f"{root}/{role}", {}))
    ray.init()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    body = {"prompt": "def main():\n    ", "max_new_tokens": args.max_new_tokens, "temperature": 0.8,
            "top_k": 32, "seed": 0, "mode": args.mode}
    results = {}
    for label, batch in (("batching on (8)", 8), ("batching off (1)", 1)):
        serve.run(build({**paths, "name": "load", "max_batch_size": batch}), name="load", route_prefix="/")
        requests.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)  # warm-up
        results[label] = load(f"http://127.0.0.1:{port}/generate", args.clients, args.requests, body, args.timeout)
        serve.delete("load")
    serve.shutdown()

    ref = results["batching off (1)"]
    print(f"\n{args.clients} clients, {args.requests} requests, {args.max_new_tokens} new tokens, mode {args.mode}")
    print(f"{'':<18}{'ok':>5}{'errors':>8}{'req/s':>8}{'vs off':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for label, r in results.items():
        print(f"{label:<18}{r['ok']:>5}{r['errors']:>8}{r['rps']:>8.2f}{r['rps'] / ref['rps']:>7.2f}x"
              f"{r['p50']:>9.0f}{r['p99']:>9.0f}")


if __name__ == "__main__":
    main()
