"""One structured config for the Hydra apps (``configs/train.yaml``), the strategy and the specs.

The schema is :class:`TrainConfig`: ``model`` is a :class:`~lightning_autopar.specs.ModelSpec` and ``cluster`` a
:class:`~lightning_autopar.specs.ClusterSpec` (the same dataclasses ``load_model_spec`` / ``load_cluster_spec``
build from ``configs/model/*.yaml`` and ``configs/cluster/*.yaml``), ``planner`` holds the strategy's keyword
arguments (:class:`PlannerConfig`), ``trainer`` the Lightning Trainer's (:class:`TrainerConfig`). The dataclasses
are registered in Hydra's ConfigStore (``register_configs``) as ``autopar_train``, the base of ``train.yaml``, so
every preset and every command-line override is type-checked.

Entry points::

    hydra_app(task, "train")              # in a script: compose from sys.argv, errors as one line (exit 2)
    compose(["trainer.devices=2"])        # in code and tests: the validated TrainConfig
    strategy_from_config(cfg), trainer_from_config(cfg, train_loader)

Hydra is told not to change the working directory (``hydra.job.chdir=False``) and writes its run files under
``outputs/``. Lightning's process launcher re-runs the script for ranks 1..N-1 with the same overrides plus
``hydra.run.dir=<rank 0's dir> hydra.output_subdir=null`` (``_SubprocessScriptLauncher`` does this when
``HydraConfig`` is initialised), so every rank composes the same config.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from lightning_autopar.errors import ConfigError
from lightning_autopar.models.vision_config import VisionConfig
from lightning_autopar.specs import ClusterSpec, ModelSpec, configs_dir, parse_fix

DEFAULT_CPU_PROCESSES = 4  # the main job's process count without CUDA


@dataclass
class PlannerConfig:
    """Keyword arguments of ``AutoParallelStrategy`` (and the Fabric strategy) besides the cluster."""

    fix: Any = None  # "tp=2,zero=3" or {tp: 2, zero: 3}: pin plan fields
    global_batch: Optional[int] = None  # default: the training DataLoader's batch size
    restrict: Any = None  # {field: [allowed values]}, e.g. {zero: [0, 3]}
    top: int = 5  # plans shown in the report
    print_plan: bool = True
    memory_fraction: float = 0.9
    # set-up measurement (docs/profiling.md; checked by runtime.trial.SetupSettings)
    trials: Optional[int] = None  # plans run a few steps before choosing; None: as the set-up budget allows; 0: off
    profile: Optional[bool] = None  # runtime profiling at set-up; None: when the budget allows
    profile_budget_s: float = 10.0  # at most this many seconds of set-up measurement
    profile_fraction: float = 0.02  # ... and at most this share of the planned run (automatic mode)
    profile_cache: Any = None  # a directory; false: no cache; None: $AUTOPAR_CACHE or ~/.cache/lightning_autopar
    # plan for `cluster` at trainer.num_nodes x trainer.devices, simulate its ranks in this process and train nothing
    simulate: bool = False


@dataclass
class TrainerConfig:
    """The Lightning Trainer arguments the apps expose (``auto``/``None``: GPUs when CUDA is present, else CPU)."""

    accelerator: str = "auto"
    devices: Optional[int] = None  # None: every GPU, or DEFAULT_CPU_PROCESSES CPU processes
    num_nodes: int = 1
    max_steps: int = 120
    precision: Optional[str] = None  # Lightning's flag, e.g. bf16-mixed; None: Lightning's default (32-true)
    gradient_clip_val: Optional[float] = None
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    enable_checkpointing: bool = False
    default_root_dir: str = "outputs"


@dataclass
class DataConfig:
    batch_size: int = 16  # the global batch of one optimizer step, as on one device
    seq_len: Optional[int] = None  # default: model.seq_len
    shuffle: bool = True


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 3e-3
    weight_decay: float = 0.0
    momentum: float = 0.9


@dataclass
class TrainConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    cluster: Optional[ClusterSpec] = None  # None: discovered from the live environment
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)  # examples/train_vision.py only
    seed: int = 0


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore as ``autopar_train``, the first default of ``train.yaml``: the
    group presets merge into its typed ``model`` / ``cluster`` / ``planner`` / ``trainer`` nodes."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="autopar_train", node=TrainConfig)


# ------------------------------------------------------------------------------------------- validation


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())


def _config_error(err: BaseException) -> ConfigError:
    """A Hydra / OmegaConf failure as one ConfigError line naming the key and the fix."""
    from omegaconf.errors import OmegaConfBaseException

    cause = err
    while cause.__cause__ is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    if type(err).__name__ == "MissingConfigException":
        group, _, name = (getattr(err, "missing_cfg_file", "") or "config").rpartition("/")
        options = getattr(err, "options", None) or []
        fix = f"use one of {', '.join(sorted(options))}" if options else f"add configs/{group or name}.yaml"
        return ConfigError(group or "config", f"no preset {name!r} in configs/{group}", fix)
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or "config"
        problem = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        fix = "see the fields of lightning_autopar.config.TrainConfig"
        if "not in struct" in problem or "Could not override" in _one_line(str(err)):
            problem = "unknown key"
            fix = "check the spelling against lightning_autopar.config.TrainConfig (see: train_gpt.py --cfg job)"
        return ConfigError(key, problem, fix)
    text = _one_line(str(err))
    return ConfigError("override", text.split(" Set the environment variable")[0] or type(err).__name__,
                       "write key=value, e.g. trainer.devices=2 planner.fix=\"tp=2\"")


def _restrict(restrict: Any) -> dict[str, list[Any]] | None:
    """``planner.restrict`` as {plan field: [allowed values]}, each value checked like a ``fix`` value."""
    if restrict is None:
        return None
    if not isinstance(restrict, Mapping):
        raise ConfigError("planner.restrict", f"expected a mapping, got {restrict!r}", "e.g. {zero: [0, 3], tp: [1]}")
    out = {}
    for key, values in restrict.items():
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if not values:
            raise ConfigError(f"planner.restrict.{key}", "empty list", "allow at least one value")
        try:
            out[str(key)] = [parse_fix({key: v})[key] for v in values]
        except ConfigError as err:
            raise ConfigError(f"planner.restrict.{key}", err.problem, err.fix) from None
    return out


def _check_setup(p: PlannerConfig) -> None:
    """``planner.trials`` / ``planner.profile*`` checked as the strategy checks them, named as in the config."""
    from lightning_autopar.runtime.trial import SetupSettings

    try:
        SetupSettings(p.trials, p.profile, p.profile_budget_s, p.profile_fraction, p.profile_cache)
    except ConfigError as err:
        raise ConfigError(f"planner.{err.field}", err.problem, err.fix) from None


def _check_precision(precision: str) -> None:
    from typing import get_args

    from lightning.fabric.connector import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS

    known = [str(v) for v in (*get_args(_PRECISION_INPUT_STR), *get_args(_PRECISION_INPUT_STR_ALIAS))]
    if str(precision) not in known:
        raise ConfigError("trainer.precision", f"unknown {precision!r}", f"use one of {', '.join(known)}")


def to_object(cfg: Any) -> TrainConfig:
    """The validated TrainConfig of a composed config; ConfigError (one line) on any bad value."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(cfg, TrainConfig):
        obj = cfg
    else:
        try:
            merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)
            obj = OmegaConf.to_object(merged)
        except OmegaConfBaseException as err:
            raise _config_error(err) from None
    assert isinstance(obj, TrainConfig)
    obj.model.validate()
    obj.vision.validate()
    if obj.cluster is not None:
        obj.cluster.validate()
    parse_fix(obj.planner.fix)
    _check_setup(obj.planner)
    obj.planner.restrict = _restrict(obj.planner.restrict)
    if obj.trainer.precision is not None:
        _check_precision(obj.trainer.precision)
    t = obj.trainer
    for name, value in (("num_nodes", t.num_nodes), ("log_every_n_steps", t.log_every_n_steps),
                        ("devices", 1 if t.devices is None else t.devices),
                        ("max_steps", 1 if t.max_steps == -1 else t.max_steps)):
        if value < 1:
            raise ConfigError(f"trainer.{name}", f"must be a positive integer, got {value}")
    if obj.data.batch_size < 1:
        raise ConfigError("data.batch_size", f"must be >= 1, got {obj.data.batch_size}")
    if obj.optim.name not in ("adamw", "sgd"):
        raise ConfigError("optim.name", f"unknown {obj.optim.name!r}", "use adamw or sgd")
    return obj


QUOTED_KEYS = ("planner.fix",)  # values of the form "tp=2,zero=3": a shell strips the user's quotes


def quote_overrides(overrides: Sequence[str]) -> list[str]:
    """Quote ``planner.fix=tp=2,zero=3`` for Hydra's grammar (where ``=`` and ``,`` would be syntax), so the
    command line works as typed: ``planner.fix="tp=2"`` reaches the program as ``planner.fix=tp=2``."""
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.lstrip("+~") in QUOTED_KEYS and value and value[0] not in "'\"{[" and value != "null":
            quote = "'" if "'" not in value else '"'
            item = f"{key}={quote}{value}{quote}"
        out.append(item)
    return out


def compose(overrides: Sequence[str] = (), config_name: str = "train") -> TrainConfig:
    """Compose ``configs/<config_name>.yaml`` with Hydra overrides (the compose API) and validate it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(configs_dir()), version_base=None, job_name="autopar"):
            cfg = hydra_compose(config_name=config_name, overrides=quote_overrides(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise _config_error(err) from None
    except Exception as err:  # noqa: BLE001  (OmegaConf raises plain errors for some merges; still bad input)
        raise ConfigError("override", _one_line(str(err)).split(" full_key")[0] or type(err).__name__,
                          "see the fields of lightning_autopar.config.TrainConfig") from None
    return to_object(cfg)


# ------------------------------------------------------------------------------------------- the app


def hydra_app(task: Callable[[TrainConfig], Any], config_name: str = "train") -> None:
    """Run ``task(TrainConfig)`` as a Hydra app over ``configs/``; a bad override or value prints one line and
    exits with code 2 (before Hydra starts, so no traceback and no output directory)."""
    import hydra

    from lightning_autopar.errors import AutoparError
    from lightning_autopar.topology.worker import install_excepthook

    install_excepthook()
    register_configs()
    sys.argv[1:] = args = quote_overrides(sys.argv[1:])  # Lightning's launcher re-runs ranks with sys.argv
    if not any(a.startswith("-") for a in args):  # --help, --cfg, -m, ...: Hydra's own handling
        compose([a for a in args if not a.startswith(("hydra.", "hydra/"))], config_name)  # every rank checks

    @hydra.main(config_path=str(configs_dir()), config_name=config_name, version_base=None)
    @functools.wraps(task)  # Hydra names the job (and its log file) after the script defining ``task``
    def _main(cfg: Any) -> None:
        try:
            task(to_object(cfg))
        except AutoparError as err:  # Hydra would print a traceback: one line and the error's exit code instead
            sys.excepthook(type(err), err, err.__traceback__)
            raise

    _main()


def resolve_devices(trainer: TrainerConfig) -> tuple[str, int]:
    """(accelerator, devices) with ``auto`` resolved: GPUs when CUDA is present, else CPU processes."""
    import torch

    accelerator = trainer.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    devices = trainer.devices
    if devices is None:
        devices = torch.cuda.device_count() if accelerator in ("gpu", "cuda") else DEFAULT_CPU_PROCESSES
    return accelerator, devices


def strategy_from_config(cfg: TrainConfig, **extra: Any) -> Any:
    """``AutoParallelStrategy`` with the planner section and the cluster of ``cfg``."""
    from lightning_autopar.strategy import AutoParallelStrategy

    p = cfg.planner
    return AutoParallelStrategy(fix=p.fix, cluster=cfg.cluster, global_batch=p.global_batch,
                                restrict=p.restrict, top=p.top, print_plan=p.print_plan,
                                memory_fraction=p.memory_fraction, trials=p.trials, profile=p.profile,
                                profile_budget_s=p.profile_budget_s, profile_fraction=p.profile_fraction,
                                profile_cache=p.profile_cache, simulate=p.simulate, **extra)


def epochs_for_steps(max_steps: int, train_loader: Any, accumulate: int = 1) -> int | None:
    """The epochs a run of ``max_steps`` optimizer steps over ``train_loader`` spans (None: no step limit or an
    unsized loader). Lightning sets max_epochs = -1 when only max_steps is given, and its rich progress bar then
    shows "Epoch 14/-2" (max_epochs - 1); this count makes it show the real last epoch, and stops where max_steps
    does."""
    try:
        batches = len(train_loader)
    except TypeError:  # an IterableDataset without __len__
        return None
    if max_steps is None or max_steps <= 0 or batches <= 0:
        return None
    steps_per_epoch = -(-batches // max(accumulate, 1))
    return -(-max_steps // steps_per_epoch)


def trainer_from_config(cfg: TrainConfig, train_loader: Any = None, **extra: Any) -> Any:
    """A Lightning Trainer with ``strategy_from_config(cfg)`` and the trainer section of ``cfg``; given the
    training DataLoader, max_epochs is the epochs max_steps spans (``epochs_for_steps``), so the progress bar
    counts real epochs."""
    import lightning.pytorch as L

    t = cfg.trainer
    accelerator, devices = resolve_devices(t)
    kwargs: dict[str, Any] = dict(
        strategy=strategy_from_config(cfg), accelerator=accelerator, devices=devices, num_nodes=t.num_nodes,
        max_steps=t.max_steps, gradient_clip_val=t.gradient_clip_val, log_every_n_steps=t.log_every_n_steps,
        enable_progress_bar=t.enable_progress_bar, enable_model_summary=t.enable_model_summary,
        enable_checkpointing=t.enable_checkpointing, default_root_dir=t.default_root_dir, logger=False,
    )
    if t.precision is not None:
        kwargs["precision"] = t.precision
    kwargs.update(extra)
    epochs = None if train_loader is None else epochs_for_steps(
        kwargs["max_steps"], train_loader, kwargs.get("accumulate_grad_batches", 1))
    if epochs is not None and kwargs.get("max_epochs") is None:
        kwargs["max_epochs"] = epochs
    return L.Trainer(**kwargs)


def gpt_config(spec: ModelSpec, **overrides: Any) -> Any:
    """The reference GPT's config for a ModelSpec (the same field names)."""
    from lightning_autopar.models import GPTConfig

    fields = dict(vocab=spec.vocab, seq_len=spec.seq_len, layers=spec.layers, hidden=spec.hidden, heads=spec.heads,
                  kv_heads=spec.kv_heads, ffn_hidden=spec.ffn_hidden, ffn_kind=spec.ffn_kind, experts=spec.experts,
                  top_k=spec.top_k, moe_every=spec.moe_every, tied_embeddings=spec.tied_embeddings)
    fields.update(overrides)
    return GPTConfig(**fields)
