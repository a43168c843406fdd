"""The seams of the code base (docs/architecture.md): inference never imports training, no import cycles,
family knowledge only in the task registry, tasks are complete contracts, models build from model-only
sections, and exports written before the model registry still load."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from efftx import models, recipes
from efftx.config import Config
from efftx.errors import ConfigError
from efftx.train import tasks

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "platform" / "efftx"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def module_level_imports(path: Path, known: set[str]) -> set[str]:
    """efftx modules that importing ``path`` imports at once (statements outside functions): an imported
    module, its packages (their ``__init__`` runs first), and ``from package import submodule`` targets."""
    name = _module_name(path)
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue  # lazy imports run when called, not when the module loads
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
            visit(ast.iter_child_nodes(node))

    visit(ast.parse(path.read_text()).body)
    edges = set()
    for target in found:
        if target in known:
            edges.add(target)
            edges.update(a for a in _ancestors(target) if a in known)
    # A submodule's own packages are being initialised when it runs: importing them is not a new edge.
    return edges - {name, *_ancestors(name)}


def import_graph() -> dict[str, set[str]]:
    """Module -> the efftx modules it imports when it loads. A package that discovers its modules
    (``pkgutil.iter_modules``: efftx.attention, so that a backend is one file) imports all of them."""
    mods = _modules()
    graph = {name: module_level_imports(path, set(mods)) for name, path in mods.items()}
    for name, path in mods.items():
        if path.name == "__init__.py" and "pkgutil.iter_modules" in path.read_text():
            graph[name] |= {m for m in mods if m.rpartition(".")[0] == name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = dfs(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert "efftx.train.tasks" in graph["efftx.train.launch"]  # the walker sees real edges
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    """Power of the test above: a backend module that imported the config (which reads the attention
    registry, whose package discovers the backend) closes a cycle."""
    graph = import_graph()
    assert "efftx.attention.local" in graph["efftx.attention"]  # discovered, so imported by the package
    assert "efftx.attention" in graph["efftx.config"]  # the config section is assembled from the registry
    graph["efftx.attention.local"] = graph["efftx.attention.local"] | {"efftx.config"}
    cycle = find_cycle(graph)
    assert cycle and "efftx.config" in cycle and "efftx.attention.local" in cycle


INFERENCE_MODULES = ["efftx.export", "efftx.generate", "efftx.generation.text_to_image", "efftx.generate_images",
                     "efftx.serving.images", "efftx.serving.text"]
TRAINING = "m.startswith('efftx.train') or m in ('efftx.tuning', 'efftx.cli')"


def test_inference_imports_no_training_code():
    """Each inference module is imported in turn into one fresh interpreter; the training modules that
    appear with it are blamed on it (one interpreter instead of six: each costs seconds of imports)."""
    code = ("import importlib, json, sys\n"
            "blame = {}\n"
            f"for module in {INFERENCE_MODULES!r}:\n"
            "    importlib.import_module(module)\n"
            f"    new = sorted(m for m in sys.modules if ({TRAINING}) and not any(m in v for v in blame.values()))\n"
            "    blame[module] = new\n"
            "print(json.dumps(blame))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    blame = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(blame) == INFERENCE_MODULES and all(v == [] for v in blame.values()), blame


def _family_checks(path: Path) -> list[str]:
    """Comparisons of a ``family`` value with a string, and ``family.startswith(...)`` calls."""
    hits = []

    def is_family(node):
        return (isinstance(node, ast.Attribute) and node.attr == "family") or (
            isinstance(node, ast.Name) and node.id == "family")

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_family(s) for s in sides) and any(
                    isinstance(s, (ast.Constant, ast.Tuple, ast.List, ast.Set)) for s in sides):
                hits.append(f"{path.name}:{node.lineno}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and is_family(node.func.value)):
            hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_no_family_string_checks_outside_the_task_registry(tmp_path):
    hits = [h for p in PACKAGE.rglob("*.py") if p != PACKAGE / "train" / "tasks.py" for h in _family_checks(p)]
    assert hits == []
    wrong = tmp_path / "cli.py"  # power: the check the CLI used to make is found
    wrong.write_text("def f(cfg):\n    if cfg.model.family != 'lm':\n        return 1\n")
    assert _family_checks(wrong) == ["cli.py:2"]


def test_every_task_is_a_complete_contract():
    for family in tasks.names():
        cls = tasks.get(family)
        assert not inspect.isabstract(cls), f"{family}: {cls.__abstractmethods__}"
        assert cls.mode in ("min", "max") and cls.metric in (cls.metric, *cls.summary_metrics)
        assert family in models.families()  # every trainable family builds a model

    class Incomplete(tasks.Task):  # a task that forgot evaluate() cannot be instantiated
        @classmethod
        def prepare(cls, cfg):
            return {}

        tokens_per_micro_batch = 1

        def train_batch(self, step, micro, rank):
            return None

        def loss(self, model, batch):
            return None

        def eval_batches(self, rank, world):
            return []

        def sample(self, model, step):
            return {}, {}

    with pytest.raises(TypeError, match="evaluate"):
        Incomplete(Config(), {})


def test_tasks_own_their_metric_and_summary():
    assert (tasks.get("lm").metric, tasks.get("dvae").metric, tasks.get("dalle").metric) == (
        "val_bpb", "val_loss", "val_loss")
    metrics = {"val_loss": 1.5, "val_bpb": 2.1, "val_recon_loss": 0.2, "val_perplexity": 9.0, "val_dead_codes": 3.0}
    assert tasks.get("lm").summary(metrics) == {"metric": "val_bpb", "mode": "min", "val_bpb": 2.1, "val_loss": 1.5}
    assert "val_bpb" not in tasks.get("dvae").summary(metrics)
    assert tasks.get("dvae").summary(metrics)["val_perplexity"] == 9.0


def test_family_checks_run_with_the_config_checks():
    from efftx import tuning

    cfg = recipes.get("dalle_shapes_debug").override({"name": "x", "model.emb_dim": 16})
    cfg.validate()  # the model-independent checks pass ...
    with pytest.raises(ConfigError, match="model.emb_dim .* not supported by the DALL-E model"):
        tasks.validate_run(cfg)  # ... the DALL-E task's do not
    space = tuning.Space("emb", "dalle_shapes_debug", grid={"model.emb_dim": [0, 16]})
    left_out = []
    assert tuning.points(space, recipes.get("dalle_shapes_debug"), log=left_out.append) == [{"model.emb_dim": 0}]
    assert "model.emb_dim" in left_out[0]


def test_resumable_keys_are_declared_by_their_sections():
    cfg = Config()
    for key in ("name", "train.steps", "data.image.sample_images", "dalle.sample_cond_scale", "tracking.uri",
                "speculative.draft", "model.activation_checkpointing",
                "scaling.storage_path", "data.cache_dir"):
        assert cfg.resumable(key), key
    for key in ("model.dim", "train.lr", "train.seed", "attention.kind", "data.seq_len", "scaling.num_workers",
                "vae.num_tokens", "engine.zero_stage"):
        assert not cfg.resumable(key), key


def test_keys_that_moved_to_their_components_section_load_from_old_configs():
    old = Config().to_dict()  # laid out as before the move: the three keys under train
    del old["data"]["image"]["sample_images"], old["dalle"]["sample_filter_thres"], old["dalle"]["sample_cond_scale"]
    old["train"].update({"sample_images": 7, "sample_filter_thres": 0.5, "sample_cond_scale": 3.0})
    cfg = Config.from_dict(old)
    assert (cfg.data.image.sample_images, cfg.dalle.sample_filter_thres, cfg.dalle.sample_cond_scale) == (7, 0.5, 3.0)
    with pytest.raises(ConfigError, match="'train.sample_images' is now 'data.image.sample_images'"):
        Config().override(["train.sample_images=2"])


def test_models_build_from_model_only_sections():
    from efftx.models.lm import LM

    cfg = recipes.get("lm_debug").override({"attention.kind": "performer", "train.seed": 3})
    torch.manual_seed(0)
    direct = LM(cfg.model, cfg.attention, seed=3)
    torch.manual_seed(0)
    via_registry = models.build(cfg)
    assert all(torch.equal(a, b) for a, b in zip(direct.state_dict().values(), via_registry.state_dict().values()))
    with pytest.raises(ConfigError, match="model.family='nope' has no model"):
        models.build(cfg.override({"model.family": "nope"}))


def test_an_export_written_before_the_model_registry_still_loads():
    """tests/data/export_v0 was written by efftx 58d3835 (LM(cfg), train/checkpoint.export) with the logits
    of fixed tokens: today's loader rebuilds the same model."""
    from efftx.export import load_export

    folder = REPO / "tests" / "data" / "export_v0"
    expected = json.loads((folder / "expected.json").read_text())
    model, cfg, meta = load_export(folder)
    assert meta["written_by"] == "efftx 58d3835" and cfg.attention.kind == "performer"
    with torch.no_grad():
        logits = model(torch.tensor(expected["tokens"]))
    assert logits.double().sum().item() == pytest.approx(expected["logits_sum"], rel=1e-6)
    assert logits[0, -1, :8].tolist() == pytest.approx(expected["logits_first"], rel=1e-5, abs=1e-6)
