"""Ray Tune sweeps over dotted config keys.

A search space is data (:class:`Space`): lists of values over config keys (a grid, or the choices of a
sampler) and, for the samplers, numeric ranges (uniform, log-uniform, integer). A named space lives in
:data:`SPACES`; a user's space is a small YAML or JSON file (:func:`load_space_file`), checked key by key
against the config (unknown key, wrong value type, empty list) before anything starts.

Three searches (``--search``): ``grid`` runs every point the run config accepts (or ``--samples N`` of them);
``random`` and ``optuna`` (Optuna's TPE, ``ray.tune.search.optuna``) propose points one trial at a time.
Either way no trial starts on a point the run config rejects (the same validation a job runs:
``Config.validate``, the attention backend's and the task's checks): grid points are filtered before the sweep
starts, each reason printed; a sampler's proposal is checked before it becomes a trial (``ValidProposals``)
and one that is rejected, or was already tried, is told to the sampler as failed and replaced.

Each trial is the same launch as a training job: a TorchTrainer (DeepSpeed, N workers) run inside a Tune
function trainable, its reports forwarded to Tune by ``TuneReportCallback`` (the Ray 2.60 pattern:
``Tuner(TorchTrainer)`` no longer works). Any family can be swept: the objective is its task's headline metric
(``Task.metric`` / ``Task.mode``: the LM's validation bits per byte, the dVAE's and DALL-E's validation loss),
on which ASHA (``--scheduler asha``, the default) stops bad trials early. Every trial is an MLflow run, child of
the sweep's parent run, which gets the results table, the best config and a plot.

A sweep survives its driver: re-running the same command (same ``--name``) restores the Tune experiment
(``Tuner.restore``): finished trials are kept, not run again; unfinished ones continue (their training runs
resume from their last checkpoint, as a job with a re-used run name does) and the search goes on from its saved
state.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from efftx import paths, recipes
from efftx.config import Config
from efftx.errors import ConfigError, LaunchError
from efftx.train.tasks import get as get_task, validate_run

SEARCHES = ("grid", "random", "optuna")
SCHEDULERS = ("asha", "none")
# A range: {kind: [low, high]}. uniform / loguniform: float keys; randint: int keys, both ends included.
RANGE_KINDS = {"uniform": "float", "loguniform": "float", "randint": "int"}
# Keys a sweep cannot vary: the trial's name and recipe, the family whose metric the sweep optimises, the
# resources checked up front (scaling.*) and where runs are recorded (tracking.*). Set them with --set.
FIXED_KEYS = ("name", "recipe", "model.family")
FIXED_SECTIONS = ("scaling.", "tracking.")
SWEEP_FILE = "efftx_sweep.json"  # in the Tune experiment folder: the sweep's settings and MLflow parent run


@dataclass(frozen=True)
class Space:
    description: str
    recipe: str  # default base recipe (its model.family's task gives the metric); "" = --recipe must name one
    grid: dict[str, list] = field(default_factory=dict)  # dotted key -> values (grid points / sampler choices)
    ranges: dict[str, tuple[str, Any, Any]] = field(default_factory=dict)  # dotted key -> (kind, low, high)
    source: str = ""  # the space file it was read from ("" = a named space)
    lines: dict[str, int] = field(default_factory=dict)  # key -> its line in the file (error messages)

    @property
    def keys(self) -> list[str]:
        return [*self.grid, *self.ranges]

    def to_dict(self) -> dict[str, Any]:
        """The space as the file format writes it."""
        return {**self.grid, **{k: {kind: [lo, hi]} for k, (kind, lo, hi) in self.ranges.items()}}


SPACES: dict[str, Space] = {
    "sinkhorn_blocks": Space(
        description="Sinkhorn bucket size x number of local-attention heads",
        recipe="sinkhorn_debug",
        grid={"attention.sinkhorn.bucket_size": [8, 16, 32], "attention.sinkhorn.n_local_attn_heads": [0, 2]},
    ),
    "performer_features": Space(
        description="Performer random features x feature redraw interval",
        recipe="performer_debug",
        grid={"attention.performer.nb_features": [16, 64, 256],
              "attention.performer.feature_redraw_interval": [0, 10]},
    ),
    # The recipe's compress_stride=0 ties the stride to the compressed block (as in the seed): the NSA options'
    # validation then drops points whose selection block is not a multiple of the compressed block, and
    # GQA's drops kv_heads that do not divide the heads.
    "nsa_blocks": Space(
        description="NSA compressed block x selection block x selected blocks x window x kv heads (of 4 heads)",
        recipe="nsa_debug",
        grid={"attention.nsa.compress_block_size": [4, 8, 16], "attention.nsa.selection_block_size": [8, 16],
              "attention.nsa.num_selected_blocks": [1, 2, 4], "attention.nsa.sliding_window_size": [8, 32],
              "model.kv_heads": [1, 2, 4]},
    ),
    "dvae_codebook": Space(
        description="dVAE codebook size x hidden width (objective: validation loss)",
        recipe="dvae_shapes_debug",
        grid={"vae.num_tokens": [32, 64, 128], "vae.hidden_dim": [16, 32]},
    ),
    # DALL-E trains on a trained dVAE: --set dalle.vae_path=EXPORT (e.g. the export of a dvae_shapes_debug run).
    "dalle_layers": Space(
        description="DALL-E attention layout x depth (objective: validation loss)",
        recipe="dalle_shapes_debug",
        grid={"dalle.attn_types": ["full", "full,axial_row", "axial_row,axial_col,conv_like"], "model.depth": [2, 4]},
    ),
}


def get_space(name: str) -> Space:
    if name not in SPACES:
        raise ConfigError(f"unknown search space {name!r}; available: {', '.join(sorted(SPACES))}")
    return SPACES[name]


# ---------------------------------------------------------------------------------------------- space checks
def _typed(key: str, value: Any) -> Any:
    """``value`` as the config stores it under ``key`` (the conversion ``--set`` does); a ConfigError names the
    key when the value does not fit its type (or the key does not exist)."""
    cfg = Config()
    cfg.set(key, value)
    return cfg.get(key)


def _numeric_kind(key: str) -> str | None:
    """"float" or "int" for a numeric key, else None (bool, str)."""
    for kind, probe in (("float", 0.5), ("int", 1)):
        try:
            value = _typed(key, probe)
        except ConfigError:
            continue
        if kind == "float" and isinstance(value, float) or kind == "int" and type(value) is int:
            return kind
    return None


def _check_entry(key: Any, spec: Any, at: str) -> tuple[str, Any]:
    """One entry of a space: ("grid", [typed values]) or ("range", (kind, low, high)). ``at`` prefixes every
    error (where the entry comes from: a file and line, or a named space)."""
    if not isinstance(key, str):
        raise ConfigError(f"{at}the key {key!r} is not a dotted config key (e.g. train.lr)")
    try:
        Config().get(key)
    except ConfigError as exc:
        raise ConfigError(f"{at}{exc}") from None
    if key in FIXED_KEYS or key.startswith(FIXED_SECTIONS):
        raise ConfigError(f"{at}{key} cannot be swept (the sweep fixes the run name and recipe, the model family "
                          f"whose metric it optimises, the per-trial resources and where runs are recorded); "
                          f"set it for every trial with --set")
    if isinstance(spec, list):
        if not spec:
            raise ConfigError(f"{at}{key}: the list of values is empty; give at least one value")
        values: list = []
        for i, value in enumerate(spec, 1):
            if isinstance(value, (list, dict)):
                raise ConfigError(f"{at}{key}: value {i} is a {type(value).__name__}, expected a single value")
            try:
                typed = _typed(key, value)
            except ConfigError as exc:
                raise ConfigError(f"{at}{key}: value {i}: {exc}") from None
            if typed in values:
                raise ConfigError(f"{at}{key}: the value {typed!r} is listed twice")
            values.append(typed)
        return "grid", values
    forms = ("a list of values, or a range: {uniform: [low, high]} or {loguniform: [low, high]} (float keys), "
             "{randint: [low, high]} (int keys, both ends included)")
    if not isinstance(spec, dict):
        raise ConfigError(f"{at}{key}: expected {forms}; got {spec!r}")
    if len(spec) != 1 or next(iter(spec)) not in RANGE_KINDS:
        raise ConfigError(f"{at}{key}: a range is one of {', '.join(RANGE_KINDS)} with [low, high]; got {spec!r}")
    kind, bounds = next(iter(spec.items()))
    numeric = _numeric_kind(key)
    if numeric is None:
        raise ConfigError(f"{at}{key} takes {type(Config().get(key)).__name__} values, so it has no range: "
                          f"list its values instead")
    if RANGE_KINDS[kind] != numeric:
        use = "randint" if numeric == "int" else "uniform or loguniform"
        raise ConfigError(f"{at}{key} is {'an int' if numeric == 'int' else 'a float'} key: its range is {use}, "
                          f"not {kind}")
    if not isinstance(bounds, list) or len(bounds) != 2:
        raise ConfigError(f"{at}{key}: {kind} takes [low, high], got {bounds!r}")
    try:
        low, high = (_typed(key, b) for b in bounds)
    except ConfigError as exc:
        raise ConfigError(f"{at}{key}: {kind} bounds: {exc}") from None
    if not low < high:
        raise ConfigError(f"{at}{key}: {kind} needs low < high, got [{low}, {high}]")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{at}{key}: loguniform needs low > 0, got {low}")
    return "range", (kind, low, high)


def _where(space: Space, key: str | None = None) -> str:
    if not space.source:
        return f"search space {space.description!r}: "
    line = space.lines.get(key) if key else None
    return f"space file {space.source}" + (f" line {line}" if line else "") + ": "


def check_space(space: Space) -> Space:
    """The space with its values typed as the config stores them; every key exists, every value fits its type,
    no list is empty, every range is well formed (errors name the key, and its line in a space file)."""
    if not space.keys:
        raise ConfigError(f"{_where(space)}the space has no key")
    grid, ranges = {}, {}
    for key, spec in [*space.grid.items(), *((k, {kind: [lo, hi]}) for k, (kind, lo, hi) in space.ranges.items())]:
        form, value = _check_entry(key, spec, _where(space, key))
        (grid if form == "grid" else ranges)[key] = value
    return replace(space, grid=grid, ranges=ranges)


def _line_of(text: str, key: str) -> int | None:
    """The first line of ``text`` where ``key`` appears as a mapping key (YAML or JSON), else None."""
    pattern = re.compile(r"(?:^|[\s{,])[\"']?" + re.escape(key) + r"[\"']?\s*:")
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.search(line):
            return number
    return None


def load_space_file(path: str | Path) -> Space:
    """A space from a YAML (.yaml/.yml) or JSON (.json) file::

        description: dVAE learning rate x codebook size     # optional
        recipe: dvae_shapes_debug                          # optional: the base recipe (--recipe overrides it)
        space:
          train.lr: {loguniform: [1.0e-4, 1.0e-2]}         # a range: random / optuna only
          vae.num_tokens: [32, 64, 128]                    # a list: grid points, or a sampler's choices

    Checked before anything starts: an unreadable or malformed file, an unknown key, a value of the wrong type,
    an empty list or a bad range is a ConfigError naming the file, the line and the key."""
    where = f"space file {path}"
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"{where}: name it .json, .yaml or .yml (the suffix chooses the parser)")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where} line {exc.lineno} column {exc.colno}: not valid JSON: {exc.msg}") from None
    else:
        try:
            import yaml
        except ImportError:  # PyYAML comes with Ray; without it, JSON still works
            raise ConfigError(f"{where}: reading YAML needs PyYAML (pip install pyyaml); or write the space as "
                              f"JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
            raise ConfigError(f"{where}{at}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    shape = ("a mapping with a 'space' section of dotted config keys (and optionally 'recipe' and "
             "'description')")
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected {shape}, got {type(data).__name__}")
    for key in data:
        if key not in ("description", "recipe", "space"):
            line = _line_of(text, str(key))
            raise ConfigError(f"{where}" + (f" line {line}" if line else "") + f": unknown section {key!r}; "
                              f"expected {shape}")
    entries = data.get("space")
    if not isinstance(entries, dict) or not entries:
        raise ConfigError(f"{where}: expected {shape}; 'space' is " +
                          ("missing" if entries is None else f"{entries!r}"))
    recipe = data.get("recipe") or ""
    if not isinstance(recipe, str):
        raise ConfigError(f"{where}: recipe must be a recipe name, got {recipe!r}")
    if recipe:
        try:
            recipes.get(recipe)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    description = data.get("description") or f"space file {p.name}"
    if not isinstance(description, str):
        raise ConfigError(f"{where}: description must be text, got {description!r}")
    space = Space(description, recipe, source=str(path),
                  lines={k: n for k in entries if isinstance(k, str) and (n := _line_of(text, k))})
    grid, ranges = {}, {}
    for key, spec in entries.items():
        form, value = _check_entry(key, spec, _where(space, key))
        (grid if form == "grid" else ranges)[key] = value
    return replace(space, grid=grid, ranges=ranges)


# ---------------------------------------------------------------------------------------------- points
def _rejection(base: Config, point: dict[str, Any]) -> str | None:
    """Why the run config rejects ``point`` (``validate_run``: the config's, the attention backend's and the
    task's checks), or None when it accepts it."""
    cfg = base.copy().override(point)
    cfg.name = cfg.name or "check"
    try:
        validate_run(cfg)
    except ConfigError as exc:
        return str(exc)
    return None


def _grid_points(grid: dict[str, list], base: Config, log=print) -> list[dict[str, Any]]:
    keys = list(grid)
    for key in keys:
        base.get(key)  # unknown key -> ConfigError naming it
    out, rejected = [], []
    for values in itertools.product(*(grid[k] for k in keys)):
        point = dict(zip(keys, values))
        why = _rejection(base, point)
        if why is None:
            out.append(point)
        else:
            rejected.append((point, why))
    for point, why in rejected:
        log(f"[efftx] search space: left out {point}: {why}")
    if not out:
        raise ConfigError(f"the search space has no valid point: {rejected[0][1]}" if rejected else
                          "the search space is empty")
    return out


def points(space: Space, base: Config, log=print) -> list[dict[str, Any]]:
    """Every grid point the run config accepts (``validate_run``: the config's, the attention backend's and the
    task's checks), in grid order. Rejected points are left out, each logged with its reason; a grid with no
    valid point is a ConfigError giving the first reason. A space with ranges has no grid: ConfigError."""
    if space.ranges:
        raise ConfigError(f"{_where(space, next(iter(space.ranges)))}{next(iter(space.ranges))} is a range: a grid "
                          f"search enumerates lists of values; use --search random or --search optuna")
    return _grid_points(space.grid, base, log)


def choose(all_points: list[dict], samples: int, seed: int) -> list[dict]:
    """All points (samples <= 0 or >= their number), else ``samples`` of them drawn without replacement."""
    if samples <= 0 or samples >= len(all_points):
        return all_points
    return random.Random(seed).sample(all_points, samples)


def _check_ranges(space: Space, base: Config, grid_point: dict[str, Any]) -> None:
    """Each range's ends, alone on top of the base config and a valid grid point, must pass the run config's
    checks: a range the config rejects at an end is an error up front (e.g. train.lr from 0)."""
    for key, (kind, low, high) in space.ranges.items():
        for end in (low, high):
            why = _rejection(base, {**grid_point, key: end})
            if why is not None:
                raise ConfigError(f"{_where(space, key)}{key}: {kind} [{low}, {high}] reaches {end}, which the run "
                                  f"config rejects: {why}")


# ---------------------------------------------------------------------------------------------- samplers
def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value the config stores."""
    return value.item() if hasattr(value, "item") else value


_SEARCHERS = ("RandomSearch", "ValidProposals")


def _define_searchers() -> None:
    """Define the Tune ``Searcher`` classes on first use (importing ``ray.tune.search`` takes seconds, which a
    space check or a bad command line should not pay) as attributes of this module, so that the pickles of them
    saved with a Tune experiment refer to them by name (``__getattr__`` below defines them on unpickling)."""
    if "ValidProposals" in globals():
        return
    from ray.tune.search import Searcher

    class RandomSearch(Searcher):
        """Uniform draws: each value of a list equally likely, ``uniform`` / ``randint`` ranges uniform,
        ``loguniform`` uniform in log space; seeded."""

        def __init__(self, grid: dict[str, list], ranges: dict[str, tuple], seed: int, metric: str, mode: str):
            super().__init__(metric=metric, mode=mode)
            self.grid, self.ranges = dict(grid), dict(ranges)
            self.rng = random.Random(seed)

        def suggest(self, trial_id):
            point = {k: self.rng.choice(v) for k, v in self.grid.items()}
            for key, (kind, low, high) in self.ranges.items():
                if kind == "randint":
                    point[key] = self.rng.randint(low, high)
                elif kind == "loguniform":
                    point[key] = math.exp(self.rng.uniform(math.log(low), math.log(high)))
                else:
                    point[key] = self.rng.uniform(low, high)
            return point

        def on_trial_complete(self, trial_id, result=None, error=False):
            pass  # draws do not learn

    class ValidProposals(Searcher):
        """Passes on an inner searcher's proposals as ``{"overrides": point}``, each checked before it becomes a
        trial: a point the run config rejects, or one already proposed, is told to the inner searcher as a
        failed trial and replaced by its next proposal, so no trial starts on an invalid point and none runs
        twice. After ``max_tries`` such proposals in a row the search ends (a small space is used up). Its state,
        the inner searcher's included, is saved with the Tune experiment: a restored sweep goes on from there."""

        def __init__(self, inner, base: Config, metric: str, mode: str, max_tries: int = 1000,
                     log_rejected: bool = True):
            super().__init__(metric=metric, mode=mode)
            self._inner = inner  # not ``searcher``: Tune would take this for a wrapper and save the inner alone
            self._base = base.to_dict()
            self._seen: set[str] = set()
            self._ids: dict[str, str] = {}  # trial id -> the inner searcher's id of its proposal
            self._logged: set[str] = set() if log_rejected else None  # the rejected points printed (at most 20)
            self._max_tries = max_tries

        def suggest(self, trial_id):
            base = Config.from_dict(self._base)
            for attempt in range(self._max_tries):
                inner_id = f"{trial_id}-{attempt}"
                proposal = self._inner.suggest(inner_id)
                if proposal is None or proposal == Searcher.FINISHED:
                    return proposal
                point = {k: _plain(v) for k, v in proposal.items()}
                key = json.dumps(point, sort_keys=True)
                why = "already tried" if key in self._seen else _rejection(base, point)
                if why is None:
                    self._seen.add(key)
                    self._ids[trial_id] = inner_id
                    return {"overrides": point}
                self._inner.on_trial_complete(inner_id, result=None, error=True)
                if why != "already tried" and self._logged is not None and key not in self._logged \
                        and len(self._logged) < 20:
                    self._logged.add(key)
                    print(f"[efftx] search: proposal {point} not run (told to the searcher as failed): {why}",
                          flush=True)
            print(f"[efftx] search: {self._max_tries} proposals in a row were invalid or already tried; no more "
                  f"trials", flush=True)
            return Searcher.FINISHED

        def on_trial_result(self, trial_id, result):
            if trial_id in self._ids:
                self._inner.on_trial_result(self._ids[trial_id], result)

        def on_trial_complete(self, trial_id, result=None, error=False):
            if trial_id in self._ids:  # else a trial whose creation came after the last saved state
                self._inner.on_trial_complete(self._ids.pop(trial_id), result=result, error=error)

        def save(self, checkpoint_path):
            import ray.cloudpickle as cloudpickle

            Path(checkpoint_path).write_bytes(cloudpickle.dumps(self.__dict__))

        def restore(self, checkpoint_path):
            import ray.cloudpickle as cloudpickle

            self.__dict__.update(cloudpickle.loads(Path(checkpoint_path).read_bytes()))

    for cls in (RandomSearch, ValidProposals):
        cls.__qualname__ = cls.__name__
        cls.__module__ = __name__
        globals()[cls.__name__] = cls


def __getattr__(name: str):
    if name in _SEARCHERS:
        _define_searchers()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _searcher(name: str):
    _define_searchers()
    return globals()[name]


def _optuna_searcher(space: Space, seed: int, metric: str, mode: str):
    """Optuna's TPE through Ray's ``OptunaSearch``: lists -> categorical, ranges -> float (log for
    loguniform) / int distributions."""
    try:
        import optuna
        from ray.tune.search.optuna import OptunaSearch
    except ImportError:
        raise ConfigError("--search optuna needs Optuna: pip install -c constraints.txt optuna (it is in the dev "
                          "extra: pip install -c constraints.txt -e '.[dev]')") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # else an INFO line per trial
    dist = optuna.distributions
    dists = {k: dist.CategoricalDistribution(v) for k, v in space.grid.items()}
    for key, (kind, low, high) in space.ranges.items():
        dists[key] = (dist.IntDistribution(low, high) if kind == "randint" else
                      dist.FloatDistribution(low, high, log=kind == "loguniform"))
    return OptunaSearch(dists, metric=metric, mode=mode, seed=seed)


def search_plan(space: Space, base: Config, search: str, samples: int, log=print) -> dict[str, Any]:
    """What Tune runs, decided before Ray starts: ``trials`` (the number), and either ``points`` (grid: the
    points, as a ``tune.grid_search``) or ``searcher`` (random / optuna: a Tune Searcher proposing valid points).
    Points the run config rejects are left out here (grid, and the lists of a sampler's space, each logged
    with its reason); a sampler's proposals are checked again as they come (``ValidProposals``)."""
    if search not in SEARCHES:
        raise ConfigError(f"--search must be one of {', '.join(SEARCHES)}; got {search!r}")
    if samples < 0:
        raise ConfigError(f"--samples must be >= 0, got {samples}")
    if search == "grid":
        chosen = choose(points(space, base, log), samples, base.train.seed)
        return {"trials": len(chosen), "points": chosen}
    task = get_task(base.model.family)
    valid = _grid_points(space.grid, base, log) if space.grid else [{}]
    _check_ranges(space, base, valid[0])
    if space.ranges:
        if samples == 0:
            raise ConfigError(f"--search {search} over ranges ({', '.join(space.ranges)}) has no end: give the "
                              f"number of trials with --samples N")
        trials = samples
    else:  # lists only: at most every valid point, each once
        trials = len(valid) if samples == 0 else min(samples, len(valid))
        if samples > len(valid):
            log(f"[efftx] search: --samples {samples} but the space has {len(valid)} valid points: "
                f"{len(valid)} trials")
    seed, metric, mode = base.train.seed, task.metric, task.mode
    inner = (_searcher("RandomSearch")(space.grid, space.ranges, seed, metric, mode) if search == "random" else
             _optuna_searcher(space, seed, metric, mode))
    log(f"[efftx] search: {search} proposes {trials} points; each is checked as grid points are (the run config's "
        f"validation) before it becomes a trial, and one rejected or already tried is replaced")
    # a space of lists had its invalid points printed above; with ranges, each rejected proposal is printed
    searcher = _searcher("ValidProposals")(inner, base, metric, mode, log_rejected=bool(space.ranges))
    return {"trials": trials, "searcher": searcher}


def _trial(config: dict[str, Any]) -> None:
    """A Tune function trainable: one training run through the normal launch."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from efftx.train.launch import launch

    cfg = Config.from_dict(config["base"]).override(config["overrides"])
    cfg.name = f"{config['sweep']}-{tune.get_context().get_trial_id()}"
    launch(cfg, parent_run_id=config["parent_run_id"], callbacks=[TuneReportCallback()])


def _trial_dirname(trial) -> str:
    """A trial's folder in the experiment: its id (Tune's default name lists the whole base config)."""
    return f"trial_{trial.trial_id}"


def _saved_trial_statuses(exp_dir: Path) -> list[str] | None:
    """The trial statuses in the newest experiment state Tune saved in ``exp_dir`` (None: no state saved)."""
    files = sorted(exp_dir.glob("experiment_state-*.json"))
    if not files:
        return None
    try:
        state = json.loads(files[-1].read_text())
        return [json.loads(trial).get("status", "?") for trial, _ in state["trial_data"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # unreadable here; Tune's own restore decides


def _check_same_sweep(name: str, before: dict[str, Any], now: dict[str, Any]) -> None:
    """A sweep resumes only with the settings it started with (Tune restores its space, search and trials)."""
    changed = [f"{k}: {before.get(k)!r} -> {now[k]!r}" for k in now if k != "config" and before.get(k) != now[k]]
    old, new = Config.from_dict(before.get("config", {})).flat(), Config.from_dict(now["config"]).flat()
    changed += [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in new if old.get(k) != new[k]]
    if changed:
        raise ConfigError(f"sweep '{name}' already exists with other settings, so it cannot be resumed "
                          f"({'; '.join(changed[:6])}); use a new --name, or the original settings")


def sweep(space: str | Space, *, recipe: str | None = None, samples: int = 0, max_concurrent: int = 2,
          overrides: list[str] | None = None, name: str | None = None, search: str = "grid",
          scheduler: str = "asha") -> dict[str, Any]:
    """Run a sweep over a named space (or a :class:`Space`, e.g. from :func:`load_space_file`); returns a summary
    with the best config, the table and the plot path. A sweep whose Tune experiment (``name``) exists resumes."""
    from efftx.train import ds_config
    from efftx.train.launch import check_resources, ensure_ray, resolve

    if isinstance(space, str):
        label, space = space, get_space(space)
    else:
        label = Path(space.source).stem if space.source else "custom"
    space = check_space(space)
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"--scheduler must be one of {', '.join(SCHEDULERS)}; got {scheduler!r}")
    if max_concurrent < 1:
        raise ConfigError(f"--max-concurrent must be >= 1, got {max_concurrent}")
    if not (recipe or space.recipe):
        raise ConfigError(f"{_where(space)}no recipe: add 'recipe: NAME' to the file or pass --recipe")
    base = recipes.get(recipe or space.recipe).override(overrides or [])
    sweep_name = name or f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    base.name = sweep_name
    base = resolve(base)
    clash = sorted(set(space.keys) & set(ds_config.keys_set(base)))
    if clash:  # every trial re-reads the file, and the file wins: the sweep would not vary these keys
        raise ConfigError(f"the sweep varies {', '.join(clash)}, which engine.deepspeed_config "
                          f"{base.engine.deepspeed_config!r} sets (the file wins); remove them from the file")
    task = get_task(base.model.family)
    metric, mode = task.metric, task.mode
    plan = search_plan(space, base, search, samples)
    trials = plan["trials"]
    concurrent = min(max_concurrent, trials)
    exp_dir = paths.home() / "tune" / sweep_name
    settings = json.loads(json.dumps({"space": label, "keys": space.to_dict(), "search": search,
                                      "scheduler": scheduler, "samples": samples, "trials": trials,
                                      "max_concurrent": concurrent, "config": base.to_dict()}))
    record_file = exp_dir / SWEEP_FILE
    record = json.loads(record_file.read_text()) if record_file.is_file() else None
    if record:
        _check_same_sweep(sweep_name, record["settings"], settings)

    ensure_ray()  # everything above is checked before Ray starts
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from efftx.tracking import Tracker

    use_gpu = base.scaling.device == "cuda" or (base.scaling.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    check_resources(base, use_gpu)
    per_trial = base.scaling.num_workers * base.scaling.cpus_per_worker
    total = ray.cluster_resources().get("CPU", 0)
    if concurrent * per_trial > total + 1e-9:
        raise LaunchError(f"--max-concurrent {concurrent} trials x {per_trial:g} CPUs each "
                          f"(scaling.num_workers x scaling.cpus_per_worker) = {concurrent * per_trial:g} CPUs, "
                          f"but the Ray cluster has {total:g}; lower --max-concurrent or the per-trial CPUs")

    statuses = _saved_trial_statuses(exp_dir)
    resuming = record is not None and statuses is not None and tune.Tuner.can_restore(str(exp_dir))
    if record:
        parent = Tracker(base, run_id=record["parent_run_id"])
    else:
        parent = Tracker(base, extra_params={"sweep.space": label, "sweep.points": trials, "sweep.search": search,
                                             "sweep.scheduler": scheduler, "sweep.grid": json.dumps(space.grid),
                                             **({"sweep.ranges": json.dumps(space.ranges)} if space.ranges else {})})
        parent.client.set_tag(parent.run_id, "efftx.sweep", label)
        exp_dir.mkdir(parents=True, exist_ok=True)
        record_file.write_text(json.dumps({"parent_run_id": parent.run_id, "settings": settings}, indent=2))
    t = base.train
    trainable = tune.with_resources(_trial, {"cpu": 0.01})  # the trial only waits on its TorchTrainer's workers
    if resuming:
        done = sum(s in ("TERMINATED", "ERROR") for s in statuses)
        if done == len(statuses) == trials:
            print(f"[efftx] sweep {sweep_name} is complete ({exp_dir}); its results:", flush=True)
        else:
            print(f"[efftx] sweep {sweep_name}: resuming its Tune experiment {exp_dir}: {done} of {trials} trials "
                  f"finished (kept, not run again), {len(statuses) - done} started and unfinished (continued from "
                  f"their last checkpoints); MLflow parent run {parent.run_id}", flush=True)
        tuner = tune.Tuner.restore(str(exp_dir), trainable, resume_unfinished=True)
    else:
        again = "re-run this command" if name else f"re-run this command with --name {sweep_name}"
        print(f"[efftx] sweep {sweep_name}: {trials} trials of {base.recipe} over {', '.join(space.keys)} "
              f"({search} search, scheduler {scheduler}); MLflow parent run {parent.run_id}; interrupted? "
              f"{again} to resume it", flush=True)
        param_space = {"base": base.to_dict(), "sweep": sweep_name, "parent_run_id": parent.run_id}
        if "points" in plan:
            param_space["overrides"] = tune.grid_search(plan["points"])
        asha = ASHAScheduler(time_attr="step", max_t=t.steps, grace_period=min(t.eval_every, t.steps),
                             reduction_factor=2) if scheduler == "asha" else None
        tuner = tune.Tuner(
            trainable,
            param_space=param_space,
            tune_config=tune.TuneConfig(metric=metric, mode=mode, scheduler=asha, max_concurrent_trials=concurrent,
                                        search_alg=plan.get("searcher"), trial_dirname_creator=_trial_dirname,
                                        num_samples=1 if "points" in plan else trials),
            run_config=tune.RunConfig(name=sweep_name, storage_path=str(exp_dir.parent), verbose=0),
        )
    grid = tuner.fit()
    statuses = _saved_trial_statuses(exp_dir) or []
    unfinished = [s for s in statuses if s not in ("TERMINATED", "ERROR")]
    if unfinished:  # Ctrl-C (SIGINT): Tune saves the experiment and returns what it has
        parent.finish("KILLED")
        raise LaunchError(f"sweep {sweep_name} was interrupted with {len(unfinished)} of {len(statuses)} trials "
                          f"unfinished; re-run the same command (--name {sweep_name}) to resume it")

    rows, trial_status = [], {}
    for result in grid:
        m = result.metrics or {}
        status = "error" if result.error else "complete" if m.get("step") == t.steps else "stopped early"
        if m.get("trial_id"):
            trial_status[f"{sweep_name}-{m['trial_id']}"] = status  # the trial's MLflow run name (see _trial)
        rows.append({**result.config["overrides"], metric: m.get(metric), "tokens_per_s": m.get("tokens_per_s"),
                     "step": m.get("step"), "status": status,
                     "error": str(result.error).strip().splitlines()[-1][:200] if result.error else ""})
    _close_trial_runs(parent, trial_status)
    finished = [r for r in rows if r[metric] is not None and not r["error"]]
    if not finished:
        parent.finish("FAILED")
        raise LaunchError(f"sweep {sweep_name}: no trial finished; first error: {rows[0]['error'] if rows else 'none'}")
    # ASHA-stopped trials report from an earlier step: compare like with like, completed trials first
    complete = [r for r in finished if r["status"] == "complete"]
    best = (min if mode == "min" else max)(complete or finished, key=lambda r: r[metric])
    keys = space.keys
    table = format_table(rows, keys, metric, mode)
    print(table, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        plot = Path(tmp) / f"{label}.png"
        plot_results(rows, keys, plot, title=f"{label} ({base.recipe}, {search})", metric=metric)
        (Path(tmp) / "results.json").write_text(json.dumps(rows, indent=2))
        parent.log_artifacts(tmp, "sweep")
    parent.log_text(table, "sweep/results.txt")
    parent.log_metrics({f"best_{metric}": best[metric]}, step=0)
    parent.client.log_param(parent.run_id, "sweep.best", json.dumps({k: best[k] for k in keys}))  # once (MLflow
    # params are immutable): an interrupted sweep never got here; one re-run when complete finds the same best
    parent.finish("FINISHED")
    return {"sweep": sweep_name, "space": label, "search": search, "scheduler": scheduler, "resumed": resuming,
            "trials": len(rows), "finished": len(finished), "metric": metric, "mode": mode,
            "best": {k: best[k] for k in keys}, f"best_{metric}": best[metric],
            "mlflow_parent_run_id": parent.run_id, "tracking_uri": base.tracking.uri,
            "experiment_path": str(exp_dir), "plot_artifact": f"sweep/{label}.png"}


def _close_trial_runs(parent, trial_status: dict[str, str]) -> None:
    """ASHA stops trials by killing them, so their driver never closes their MLflow run, and that includes every
    trial that completes: ASHA also stops a trial at its report from step ``max_t`` (train.steps), after the final
    evaluation and the export but before its launch returns. Once the sweep is over, a child run still RUNNING
    is marked FINISHED if Tune saw its trial complete (``trial_status``: run name -> results-table status), else
    KILLED."""
    exp = parent.client.get_run(parent.run_id).info.experiment_id
    children = parent.client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'")
    for child in children:
        if child.info.status == "RUNNING":
            complete = trial_status.get(child.info.run_name) == "complete"
            parent.client.set_terminated(child.info.run_id, status="FINISHED" if complete else "KILLED")


def format_table(rows: list[dict], keys: list[str], metric: str, mode: str = "min") -> str:
    """The results, best first."""
    cols = keys + [metric, "tokens_per_s", "step", "status", "error"]
    short = {k: k.split(".")[-1] for k in cols}

    def cell(v):
        if isinstance(v, float):
            return f"{v:,.4f}" if abs(v) < 100 else f"{v:,.0f}"
        return "" if v is None else str(v)[:40]

    sign = 1 if mode == "min" else -1
    ranked = sorted(rows, key=lambda r: (r[metric] is None, sign * (r[metric] or 0)))
    body = [[cell(r.get(c)) for c in cols] for r in ranked]
    widths = [max(len(short[c]), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    lines = ["  ".join(short[c].ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def plot_results(rows: list[dict], keys: list[str], out: Path, title: str, metric: str) -> None:
    """Metric against the first swept key, one line per combination of the other keys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key, other = keys[0], keys[1:]
    fig, ax = plt.subplots(figsize=(6, 4))
    groups: dict[tuple, list[tuple]] = {}
    for r in rows:
        if r[metric] is not None and not math.isnan(r[metric]):
            groups.setdefault(tuple(r[k] for k in other), []).append((r[x_key], r[metric], r.get("status")))
    for group, pts in sorted(groups.items(), key=lambda kv: str(kv[0])):
        pts.sort(key=lambda p: (p[0], p[1]))
        label = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(other, group)) or metric
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        stopped = [p for p in pts if p[2] == "stopped early"]
        if stopped:  # hollow markers: ASHA stopped these trials, their value is from an earlier step
            ax.plot([p[0] for p in stopped], [p[1] for p in stopped], "o", markersize=11, fillstyle="none",
                    color=line.get_color())
    if any(r.get("status") == "stopped early" for r in rows):
        ax.plot([], [], "o", fillstyle="none", color="gray", markersize=11, label="stopped early by ASHA")
    ax.set_xlabel(x_key)
    ax.set_ylabel(f"validation {metric} (last report)")
    ax.set_title(title)
    if all(isinstance(r[x_key], (int, float)) and r[x_key] > 0 for r in rows):
        ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def sweep_main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Sweep dotted config keys with Ray Tune over the efftx train loop.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--space", help=f"named search space: {', '.join(sorted(SPACES))}")
    which.add_argument("--space-file", metavar="PATH",
                       help="a search space in a YAML or JSON file: 'space:' maps dotted config keys to a list of "
                            "values or a range ({uniform|loguniform|randint: [low, high]}); optional 'recipe:', "
                            "'description:' (see examples/space_dvae_lr.yaml)")
    p.add_argument("--search", choices=SEARCHES, default="grid",
                   help="grid: every valid point (or --samples of them); random: uniform draws; optuna: Optuna's "
                        "TPE. Invalid or repeated points never start (default: grid)")
    p.add_argument("--scheduler", choices=SCHEDULERS, default="asha",
                   help="asha: stop bad trials early at each evaluation; none: every trial runs to the end "
                        "(default: asha)")
    p.add_argument("--recipe", help="base recipe (default: the space's own)")
    p.add_argument("--samples", type=int, default=0,
                   help="grid: points drawn from the grid (0 = the whole grid); random/optuna: number of trials "
                        "(0 = every valid point of a space of lists; needed with ranges)")
    p.add_argument("--max-concurrent", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--name", help="sweep name (Tune experiment and MLflow parent run); re-running a command with "
                                  "the name of an interrupted sweep resumes it")
    args = p.parse_args(argv)
    from efftx.cli import run_reporting

    def work():
        space = load_space_file(args.space_file) if args.space_file else args.space
        return sweep(space, recipe=args.recipe, samples=args.samples, max_concurrent=args.max_concurrent,
                     overrides=args.overrides, name=args.name, search=args.search, scheduler=args.scheduler)

    return run_reporting(work)
