"""Check a dataset a user brings before training on it: ``python -m efftx.data.prepare enwik8 PATH``.

enwik8 is the first 10^8 bytes of an English Wikipedia XML dump (Matt Mahoney's Large Text Compression
Benchmark, http://mattmahoney.net/dc/enwik8.zip; the original scripts read it as ``enwik8.gz``). This command
takes ``enwik8.zip`` as distributed, a ``.gz`` or the raw file; unpacks it once into efftx's data cache (the
same cache, and the same flat file, a training run memory-maps: nothing is unpacked twice); checks it is the
real file (100,000,000 bytes, starting with the ``<mediawiki`` header); prints its SHA-256 and the command that
trains on it. A wrong file is exit code 1 with what is wrong (size, header); a missing or unreadable one, 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from efftx import paths
from efftx.data.bytes import prepare
from efftx.errors import DataError

DATASETS = {
    "enwik8": {"size": 100_000_000, "header": b"<mediawiki ", "recipe": "sinkhorn_enwik8",
               "where": "http://mattmahoney.net/dc/enwik8.zip (about 36 MB zipped)"},
}


def check(name: str, source: str, cache_dir: str | None = None) -> dict:
    """Unpack (cached) and check ``source`` as dataset ``name``; -> a report dict with "ok" and "problems"."""
    spec = DATASETS[name]
    info = prepare(source, cache_dir or paths.default_data_dir(), seq_len=1)
    with open(info.path, "rb") as fh:
        head = fh.read(len(spec["header"]))
    problems = []
    if info.size != spec["size"]:
        problems.append(f"it has {info.size:,} bytes once unpacked; {name} has {spec['size']:,}")
    if head != spec["header"]:
        problems.append(f"it starts with {head!r}, not {name}'s {spec['header']!r} header")
    return {"dataset": name, "source": str(Path(source).expanduser().resolve()), "unpacked": info.path,
            "bytes": info.size, "sha256": info.sha256, "ok": not problems, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m efftx.data.prepare", description=__doc__.splitlines()[0])
    p.add_argument("dataset", choices=sorted(DATASETS))
    p.add_argument("path", help="the file as you have it (enwik8.zip, enwik8.gz or the raw enwik8)")
    p.add_argument("--cache-dir", help="where to unpack (default: efftx's data cache, where training looks)")
    args = p.parse_args(argv)
    spec = DATASETS[args.dataset]
    try:
        report = check(args.dataset, args.path, args.cache_dir)
    except DataError as exc:
        print(f"error: {exc}\n(get {args.dataset} from {spec['where']})", file=sys.stderr)
        return 2
    if not report["ok"]:
        print(f"error: {report['source']} is not {args.dataset}: " + "; ".join(report["problems"])
              + f"\n(get it from {spec['where']})", file=sys.stderr)
        return 1
    print(f"{args.dataset}: {report['source']} is the real file ({report['bytes']:,} bytes, "
          f"{spec['header'].decode().strip()} header)\n"
          f"sha256 {report['sha256']} (of the {report['bytes']:,} unpacked bytes)\n"
          f"unpacked once to {report['unpacked']} (training memory-maps it from there)\n"
          f"train on it: python jobs/train_sinkhorn.py --recipe {spec['recipe']} "
          f"--set data.corpus={report['source']}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
