"""Language models on a tokenizers JSON (data.tokenizer): the tokenizer CLI, the tokenized corpus and its split,
bits per byte, incremental decoding, the speculative pair's tokenizer check, and a real training run whose export
generates text through efftx.generate and the Serve app."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from efftx import recipes
from efftx.data.bytes import ByteData, prepare
from efftx.data.lm_tokenizer import ByteCodec, TokenizerCodec, export_codec, load_codec, same_tokenizer
from efftx.data.token_corpus import TokenData, prepare_tokens, split_bounds
from efftx.errors import ConfigError, DataError, ExportError

REPO = Path(__file__).resolve().parents[1]
UNICODE_LINE = "# héllo wörld ✓ 😀 日本語 — ünïcödé\n"


def run_cli(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "efftx.data.train_tokenizer", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About 400 KB of Python source with multi-byte characters every 40 lines (the same every run)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for name in ("textwrap.py", "difflib.py", "argparse.py", "dataclasses.py", "inspect.py", "typing.py"):
        for i, line in enumerate((stdlib / name).read_text(encoding="utf-8").splitlines(keepends=True)):
            out.append(line)
            if i % 40 == 0:
                out.append(UNICODE_LINE)
            size += len(line)
        if size > 400_000:
            break
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(out), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "bpe-384.json"
    proc = run_cli(str(corpus), "--vocab", "384", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


# ----------------------------------------------------------------------------------------------- the CLI

@pytest.fixture(scope="module")
def unigram(corpus, tmp_path_factory) -> Path:
    """A unigram tokenizer of the same vocabulary size as ``bpe``."""
    out = tmp_path_factory.mktemp("tok") / "unigram-384.json"
    proc = run_cli(str(corpus), "--vocab", "384", "--kind", "unigram", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"--set data.tokenizer={out}" in proc.stdout and str(out) in proc.stdout.splitlines()[0]
    return out


def test_train_tokenizer_cli_writes_byte_level_tokenizers_that_round_trip_any_text(bpe, unigram):
    codec = load_codec(str(bpe))
    assert codec.vocab_size == 384 and load_codec(str(unigram)).vocab_size == 384
    for tok in (codec, load_codec(str(unigram))):
        for text in ("def f(x):\n    return x  # ok", UNICODE_LINE, "\x00\x7f\t\r\n  ", "zß水🀄️ \u200b€"):
            ids = tok.encode(text)
            assert ids and max(ids) < tok.vocab_size
            assert tok.decode(ids) == text
    assert len(codec.encode("def __init__(self):\n        return")) < len("def __init__(self):\n        return")


def test_train_tokenizer_cli_bad_input_is_one_line_and_exit_2(corpus, bpe, tmp_path):
    cases = [
        (run_cli(str(tmp_path / "missing.txt"), "--vocab", "300"), "corpus not found"),
        (run_cli(str(corpus), "--vocab", "200", "--out", str(tmp_path / "x.json")), "--vocab 200 is too small"),
        (run_cli(str(corpus), "--vocab", "300", "--out", str(bpe)), "exists; pass --force"),
        (run_cli(str(corpus), "--vocab", "300", "--out", str(tmp_path)), "is a folder"),
    ]
    for proc, message in cases:
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    before = bpe.read_bytes()
    assert bpe.read_bytes() == before  # the refused run left the existing file alone


# ------------------------------------------------------------------------------------ config and errors

def test_vocab_comes_from_the_tokenizer_and_an_explicit_mismatch_is_an_error(bpe, tmp_path):
    from efftx.train.launch import resolve

    cfg = resolve(recipes.get("lm_debug").override({"name": "t", "data.tokenizer": str(bpe)}))
    assert cfg.model.vocab_size == 384
    assert resolve(recipes.get("lm_debug").override({"name": "t", "data.tokenizer": str(bpe),
                                                    "model.vocab_size": 384})).model.vocab_size == 384
    with pytest.raises(DataError, match=r"model.vocab_size=300 but data.tokenizer=.* has a vocabulary of 384"):
        resolve(recipes.get("lm_debug").override({"name": "t", "data.tokenizer": str(bpe), "model.vocab_size": 300}))
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "1.0", "model": {"type": "nonsense"}}')
    with pytest.raises(DataError, match="is not a Hugging Face tokenizers JSON file"):
        resolve(recipes.get("lm_debug").override({"name": "t", "data.tokenizer": str(bad)}))
    with pytest.raises(DataError, match="tokenizer file not found"):
        resolve(recipes.get("lm_debug").override({"name": "t", "data.tokenizer": str(tmp_path / "none.json")}))
    with pytest.raises(ConfigError, match="data.tokenizer=.* is a folder"):
        recipes.get("lm_debug").override({"name": "t", "data.tokenizer": str(tmp_path)}).validate()


def test_bad_tokenizer_json_through_the_job_script_is_exit_2_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    proc = subprocess.run([sys.executable, "jobs/train_lm.py", "--recipe", "lm_debug", "--set",
                           f"data.tokenizer={bad}", "--print-config"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout
    assert "is not a Hugging Face tokenizers JSON file (data.tokenizer)" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------- the tokenized corpus

def test_tokenized_corpus_is_cached_and_splits_the_text_as_the_byte_model_does(corpus, bpe, unigram, tmp_path):
    codec = load_codec(str(bpe))
    info = prepare(str(corpus), tmp_path, 64)
    first = prepare_tokens(info, codec, tmp_path, 64, str(bpe))
    folder = Path(first.path)
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    second = prepare_tokens(info, codec, tmp_path, 64, str(bpe))
    assert second == first and {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps  # reused
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # nothing half-written left behind
    assert first.dtype == "uint16" and first.tokenizer_sha256 == codec.sha256 and first.corpus_sha256 == info.sha256

    data, raw = TokenData(first), ByteData(info)
    # the validation text is the byte model's validation split, byte for byte (ASCII boundaries here)
    assert codec.decode(np.asarray(data.val).tolist()).encode() == bytes(raw.val)
    assert codec.decode(np.asarray(data.train).tolist()).encode() == bytes(raw.train)
    # every validation byte is counted once, by the token that covers it
    assert int(np.asarray(data.val_bytes, dtype=np.int64).sum()) == len(raw.val) == first.val_bytes
    ids = np.asarray(data.val).tolist()
    ends = np.cumsum(np.asarray(data.val_bytes, dtype=np.int64))
    for i in range(0, len(ids), 97):  # a token boundary is where the decoded prefix ends (byte-level BPE)
        assert len(codec.decode(ids[:i + 1]).encode()) == ends[i]
    # another tokenizer is another cache
    assert prepare_tokens(info, load_codec(str(unigram)), tmp_path, 64, str(unigram)).path != first.path


def test_split_boundaries_move_to_character_ends_and_invalid_bytes_count_as_bytes(bpe, tmp_path):
    codec = load_codec(str(bpe))
    blob = b"a" + ("日本語の文章。" * 300).encode()  # then 3-byte characters only, starting at byte 1
    n_train = int(len(blob) * 0.9)
    assert blob[n_train] & 0xC0 == 0x80  # 90% of the length falls inside a character
    (t0, t1), (v0, v1) = split_bounds(np.frombuffer(blob, dtype=np.uint8))
    assert t0 == 0 and t1 == v0 and 0 < v0 - n_train <= 2 and v0 % 3 == 1  # the next character's start
    text_file = tmp_path / "jp.txt"
    # a stray continuation byte and an invalid byte in the validation split: the tokenizer sees U+FFFD, the bytes
    # still count once each
    text_file.write_bytes(blob[:v0 + 30] + b"\x80\xff" + blob[v0 + 30:])
    info = prepare(str(text_file), tmp_path / "cache", 16)
    tokens = prepare_tokens(info, codec, tmp_path / "cache", 16, str(bpe))
    data = TokenData(tokens)
    (_, _), (v0, v1) = split_bounds(np.memmap(info.path, dtype=np.uint8, mode="r"))
    assert tokens.val_bytes == v1 - v0 == int(np.asarray(data.val_bytes, dtype=np.int64).sum())
    assert "\ufffd\ufffd" in codec.decode(np.asarray(data.val).tolist())


def test_a_corpus_too_short_in_tokens_is_a_clear_error(bpe, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("        return self\n" * 250)  # 5,000 bytes: 250 validation bytes, far fewer tokens
    info = prepare(str(short), tmp_path, 200)  # enough bytes for the byte model
    with pytest.raises(DataError, match=r"validation tokens .* data.seq_len \+ 2 = 202"):
        prepare_tokens(info, load_codec(str(bpe)), tmp_path, 200, str(bpe))


# ------------------------------------------------------------------------------------------ bits per byte

class Uniform(torch.nn.Module):
    """Zero logits: every token costs exactly ln(vocab) nats."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return torch.zeros(*x.shape, self.vocab) + 0 * self.w


def lm_task(cfg):
    from efftx.train.launch import resolve
    from efftx.train.tasks import LMTask

    cfg = resolve(cfg)
    return LMTask(cfg, LMTask.prepare(cfg)), cfg


def ranks_mean(task, model, world: int) -> dict[str, float]:
    """What the loop reports: each rank evaluates its share, then the window-weighted mean over ranks
    (efftx.train.loop.all_mean)."""
    parts = [task.evaluate(model, task.eval_batches(rank, world)) for rank in range(world)]
    total = sum(n for _, n in parts)
    return {k: sum(m[k] * n for m, n in parts) / total for k in parts[0][0]}


def test_bits_per_byte_hand_computed():
    from efftx.train.tasks import bits_per_byte

    # 4 tokens covering 10 bytes, 2 nats per token: 8 nats / 10 bytes / ln 2
    assert bits_per_byte(2.0, 4 / 10) == pytest.approx(8 / 10 / math.log(2), rel=1e-12)
    assert bits_per_byte(math.log(256), 1.0) == pytest.approx(8.0, rel=1e-12)  # uniform over bytes: 8 bits


def test_val_bpb_of_a_token_model_is_nats_over_the_bytes_its_tokens_cover(corpus, bpe):
    task, cfg = lm_task(recipes.get("lm_debug").override({
        "name": "bpb", "data.corpus": str(corpus), "data.tokenizer": str(bpe), "train.eval_batches": 3}))
    codec = load_codec(str(bpe))
    # the validation windows' targets, counted here by decoding them (the corpus is ASCII at window edges often,
    # not always: decode each whole window and subtract its first token's text)
    t = cfg.train
    windows = task.data.val_windows(t.eval_batches * t.micro_batch_size, cfg.data.seq_len)
    tokens = windows.shape[0] * cfg.data.seq_len
    covered = sum(int(task.data.val_bytes[s + 1: s + cfg.data.seq_len + 1].sum())
                  for s in task.data.val_starts(windows.shape[0], cfg.data.seq_len))
    by_decoding = 0
    for row in windows.tolist():
        whole, head = codec.decode(row).encode(), codec.decode(row[:1]).encode()
        by_decoding += len(whole) - len(head)
    assert abs(by_decoding - covered) <= 3 * windows.shape[0]  # a character split at a window's edge
    assert covered > 1.5 * tokens  # a token covers about two bytes: the cases below differ
    uniform = Uniform(cfg.model.vocab_size)
    for world in (1, 2):
        m = ranks_mean(task, uniform, world)
        assert m["val_loss"] == pytest.approx(math.log(384), rel=1e-6)
        # total nats / bytes / ln 2 = ln(384) * tokens / bytes / ln 2
        assert m["val_bpb"] == pytest.approx(math.log2(384) * tokens / covered, rel=1e-6)


def test_val_bpb_of_a_byte_model_is_unchanged(corpus):
    from efftx.models import build

    task, cfg = lm_task(recipes.get("lm_debug").override({"name": "bytes", "data.corpus": str(corpus)}))
    assert task.val_tokens_per_byte == 1.0 and isinstance(task.codec, ByteCodec)
    torch.manual_seed(0)
    model = build(cfg).eval()
    batches = task.eval_batches(0, 1)
    metrics, n = task.evaluate(model, batches)
    # the formula before token models: per-window mean of the batches' mean cross-entropy, over ln 2
    total = 0.0
    with torch.no_grad():
        for b in batches:
            logits = model(b[:, :-1])
            total += torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                       b[:, 1:].reshape(-1)).item() * b.shape[0]
    assert metrics["val_bpb"] == (total / n) / math.log(2)  # bit for bit
    assert metrics["val_bpb"] == metrics["val_loss"] / math.log(2)
    assert ranks_mean(task, Uniform(256), 2)["val_bpb"] == pytest.approx(8.0, rel=1e-6)  # float32 ln 256


# -------------------------------------------------------------------------------------------- decoding

def test_incremental_decoding_never_emits_broken_characters(bpe):
    codec = load_codec(str(bpe))
    text = "naïve café — 😀 日本語 ok\n" * 3
    ids = codec.encode(text)
    assert len(ids) > len(text) / 3
    for context in ([], codec.encode("print(")):
        for step in (1, 2, 5):  # one token at a time, or several per step (speculative decoding)
            dec = codec.decoder(context)
            pieces = [dec.decode(ids[i:i + step]) for i in range(0, len(ids), step)] + [dec.flush()]
            assert "".join(pieces) == text == codec.continuation(context, ids)
            assert all("\ufffd" not in p for p in pieces)
    # a tail the model left unfinished comes out as U+FFFD at the end, and only then
    emoji = codec.encode("😀")
    assert len(emoji) > 1
    dec = codec.decoder()
    assert dec.decode(emoji[:-1]) == "" and dec.flush() == "\ufffd"
    # bytes: the same as before (UTF-8 incremental decoding)
    dec = ByteCodec().decoder()
    raw = list("é😀".encode())
    assert [dec.decode([b]) for b in raw] + [dec.flush()] == ["", "é", "", "", "", "😀", ""]


def token_export(bpe: Path, root: Path, seed: int, recipe: str = "spec_target_debug") -> Path:
    from efftx.export import TOKENIZER_FILE, export
    from efftx.models import build

    codec = load_codec(str(bpe))
    cfg = recipes.get(recipe).override({"data.tokenizer": str(bpe), "model.vocab_size": codec.vocab_size})
    torch.manual_seed(seed)
    return export(build(cfg), cfg, root, {}, files={TOKENIZER_FILE: codec.to_json()})


def test_generate_and_streaming_decode_a_token_export(bpe, tmp_path, one_thread):
    from efftx.generate import sample_text
    from efftx.generation.decode import generate
    from efftx.export import load_export
    from efftx.serving.schemas import StreamRequest
    from efftx.serving.streaming import stream_events

    folder = token_export(bpe, tmp_path / "target", 0)
    model, cfg, _ = load_export(folder)
    codec = export_codec(folder, cfg)
    assert codec.sha256 == TokenizerCodec(bpe.read_text(), "x").sha256
    prompt = "def naïve("
    ids = codec.encode(prompt)
    out = generate(model, [ids], 30, temperature=1.0, seed=3)[0].tolist()
    text = sample_text(str(folder), prompt, 30, temperature=1.0, seed=3)
    assert text == codec.continuation(ids, out) and len(text) > 0
    events = list(stream_events(model, None, ids, StreamRequest(prompt=prompt, max_new_tokens=30, temperature=1.0,
                                                                 seed=3, mode="base"), codec))
    *steps, done = events
    assert "".join(s.text for s in steps) + done.tail == text == done.text
    assert done.tokens == 30
    cli = subprocess.run([sys.executable, "-m", "efftx.generate", "--model", str(folder), "--prompt", prompt,
                          "--max-new-tokens", "30", "--seed", "3", "--temperature", "1"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == prompt + text + "\n"
    # an export that lost its tokenizer.json is refused, not decoded as bytes
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ExportError, match="holds no tokenizer.json"):
        sample_text(str(folder), prompt, 5)


def test_speculative_draft_must_share_the_tokenizer(corpus, bpe, unigram, tmp_path):
    from efftx.train.launch import resolve
    from efftx.train.tasks import LMTask

    other_json = unigram
    same, other = load_codec(str(bpe)), load_codec(str(other_json))
    assert same.vocab_size == other.vocab_size
    assert same_tokenizer(same, load_codec(str(bpe))) is None
    assert "tokenize differently" in same_tokenizer(same, other)
    assert "vocabulary of 384, the draft 256" in same_tokenizer(same, ByteCodec())

    base = {"data.corpus": str(corpus), "data.tokenizer": str(bpe)}
    good = token_export(bpe, tmp_path / "good", 1, "spec_draft_debug")
    bad = token_export(other_json, tmp_path / "bad", 1, "spec_draft_debug")
    cfg = resolve(recipes.get("spec_target_debug").override({"name": "s", **base, "speculative.draft": str(good)}))
    assert LMTask.prepare(cfg)["params"]["data.tokenizer_vocab"] == 384
    cfg = resolve(recipes.get("spec_target_debug").override({"name": "s", **base, "speculative.draft": str(bad)}))
    with pytest.raises(ConfigError, match="tokenize differently"):
        LMTask.prepare(cfg)


# --------------------------------------------------------------------------- a real run, generate, Serve

@pytest.fixture(scope="module")
def token_run(ray_cluster, corpus, bpe):
    from efftx.train.launch import launch

    return launch(recipes.get("lm_debug").override({
        "name": "token-lm", "data.corpus": str(corpus), "data.tokenizer": str(bpe), "train.steps": 20,
        "train.eval_every": 10, "train.warmup_steps": 4, "train.sample_every": 20}))


@pytest.mark.slow
def test_token_lm_trains_logs_the_tokenizer_and_its_export_generates_text(token_run, bpe):
    from mlflow import MlflowClient

    from efftx.export import TOKENIZER_FILE, read_export_config
    from efftx.generate import sample_text

    codec = load_codec(str(bpe))
    assert token_run["final_step"] == 20
    client = MlflowClient(tracking_uri=token_run["tracking_uri"])
    run = client.get_run(token_run["mlflow_run_id"])
    params = run.data.params
    assert params["data.tokenizer"] == str(bpe) and params["model.vocab_size"] == "384"
    assert params["data.tokenizer_sha256"] == codec.sha256 and params["data.tokenizer_vocab"] == "384"
    bpb = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_bpb")}
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_loss")}
    assert sorted(bpb) == [0, 10, 20] and bpb[20] < bpb[0]
    ratio = bpb[0] / (loss[0] / math.log(2))  # tokens per byte of the validation windows, the same at every step
    assert 0.3 < ratio < 0.7 and bpb[20] == pytest.approx(loss[20] / math.log(2) * ratio, rel=1e-6)
    assert token_run["val_bpb"] == pytest.approx(bpb[20])

    export = Path(token_run["export_path"])
    assert (export / TOKENIZER_FILE).read_text(encoding="utf-8") == codec.to_json()
    cfg, _ = read_export_config(export)
    assert cfg.model.vocab_size == 384 and cfg.data.tokenizer == str(bpe)
    cmd = [sys.executable, "-m", "efftx.generate", "--model", str(export), "--prompt", "def ",
           "--max-new-tokens", "40", "--temperature", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    expected = sample_text(str(export), "def ", 40, temperature=0)
    assert proc.stdout == "def " + expected + "\n" and len(expected.encode()) >= 40  # a token is a byte or more
    samples = [a.path for a in client.list_artifacts(run.info.run_id, "samples")]
    assert samples == ["samples/step_000020.txt"]


@pytest.mark.slow
def test_serve_app_encodes_and_decodes_with_the_exports_tokenizer(token_run, ray_cluster):
    import requests
    from ray import serve

    from netutil import free_port

    from efftx.generate import sample_text
    from efftx.serving.text import build

    export = token_run["export_path"]
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build({"target": export, "draft": export, "name": "tok"}), name="tokens", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        prompt = "class Naïve:"
        expected = sample_text(export, prompt, 24, temperature=0)
        r = requests.post(f"{url}/generate", json={"prompt": prompt, "max_new_tokens": 24, "temperature": 0,
                                                   "mode": "both", "gamma": 3}, timeout=120)
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert res["base"]["text"] == res["speculative"]["text"] == expected and res["base"]["tokens"] == 24
        body = {"model": "tok", "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
        pieces = []
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as s:
            for line in s.iter_lines(decode_unicode=True):
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(pieces) == expected and all("\ufffd" not in p for p in pieces)
    finally:
        serve.shutdown()
