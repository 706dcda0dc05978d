"""Describe your model as the planner sees it and write its model spec (autopar analyze).

    autopar analyze --model lightning_autopar.models.vision:resnet152 --input pixel_values=3x224x224 \\
        -o resnet152.yaml
    autopar plan --model resnet152.yaml --cluster a100-80g-dgx --nodes 4 --global-batch 1024

``--model`` is ``package.module:factory`` or ``path/to/file.py:factory``: a callable with no arguments returning
the ``nn.Module``. It is called under ``torch.device("meta")`` and the model is traced on meta tensors
(``profile.units.analyze_model``), so a model too big for this machine costs nothing. ``--input`` gives one
sample's shape per model argument (the batch dimension is added): ``3x224x224`` (first positional argument),
``pixel_values=3x224x224`` (keyword), ``input_ids=512:long`` (dtype). A model with a stack of attention blocks is
written in transformer form, anything else in unit form (``units:``). Exit codes: 0 ok; 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from lightning_autopar.errors import ConfigError

DTYPES = ("float", "long", "int", "bool", "half", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="package.module:factory or file.py:factory (no arguments)")
    parser.add_argument("--input", action="append", default=[], metavar="[NAME=]SHAPE[:DTYPE]",
                        help="one sample's shape per model argument, e.g. pixel_values=3x224x224 or 512:long")
    parser.add_argument("--name", default=None, help="the spec's name (default: the factory's)")
    parser.add_argument("-o", "--output", default=None, metavar="FILE.yaml", help="write the model spec here")


def load_factory(target: str) -> Callable[[], Any]:
    """``module:attr`` or ``file.py:attr`` -> the callable; ConfigError naming ``--model`` otherwise."""
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError("--model", f"{target!r} is not module:factory", "e.g. mypkg.models:build or model.py:build")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ConfigError("--model", f"file {where} not found")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.path.insert(0, str(path.resolve().parent))
            try:
                spec.loader.exec_module(module)
            finally:
                sys.path.pop(0)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as err:  # the user's file failed to import: bad input, named
        raise ConfigError("--model", f"cannot import {where}: {type(err).__name__}: {str(err).splitlines()[0]}"
                          if str(err) else f"cannot import {where}: {type(err).__name__}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError("--model", f"{where} has no callable {attr!r}")
    return factory


def parse_input(text: str) -> tuple[str | None, tuple[int, ...], str]:
    """``[NAME=]SHAPE[:DTYPE]`` -> (keyword or None, per-sample shape, dtype name)."""
    name, sep, rest = text.partition("=")
    if not sep:
        name, rest = None, text
    shape_text, _, dtype = rest.partition(":")
    dtype = dtype or "float"
    try:
        shape = tuple(int(d) for d in shape_text.lower().split("x")) if shape_text else ()
    except ValueError:
        shape = (-1,)
    if any(d < 1 for d in shape) or (name is not None and not name.isidentifier()):
        raise ConfigError("--input", f"{text!r} is not [NAME=]SHAPE[:DTYPE]", "e.g. pixel_values=3x224x224")
    if dtype not in DTYPES:
        raise ConfigError("--input", f"unknown dtype {dtype!r} in {text!r}", f"use one of {', '.join(DTYPES)}")
    return name, shape, dtype


def example_call(inputs: list[str]) -> tuple[tuple, dict]:
    """Meta tensors of batch 1 for each ``--input``: (args, kwargs)."""
    import torch

    if not inputs:
        raise ConfigError("--input", "missing", "give one sample's shape, e.g. --input pixel_values=3x224x224")
    args, kwargs = [], {}
    for text in inputs:
        name, shape, dtype = parse_input(text)
        tensor = torch.zeros((1, *shape), dtype=getattr(torch, dtype), device="meta")
        if name is None:
            if kwargs:
                raise ConfigError("--input", f"positional {text!r} after a keyword input", "give positional first")
            args.append(tensor)
        else:
            kwargs[name] = tensor
    return tuple(args), kwargs


def spec_yaml(spec: Any, header: str) -> str:
    """The ModelSpec as YAML under a comment ``header``: unit form (``units:``, one flow mapping per unit) or
    the transformer fields."""
    import yaml

    comment = "".join(f"# {line}\n" for line in header.splitlines())
    if not spec.unit_form:
        data = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("units", "moe_replay", "vocab_parallel")}
        return comment + yaml.safe_dump(data, sort_keys=False)
    rows = []
    for unit in spec.units:
        row = {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in dataclasses.asdict(unit).items()}
        rows.append("  - " + yaml.safe_dump(row, default_flow_style=True, sort_keys=False, width=10**6).strip())
    return comment + yaml.safe_dump({"name": spec.name}, sort_keys=False) + "units:\n" + "\n".join(rows) + "\n"


def run(args: argparse.Namespace) -> int:
    import torch

    from lightning_autopar.profile.units import analyze_model

    factory = load_factory(args.model)
    example = example_call(args.input)
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as err:
        raise ConfigError("--model", f"{args.model} raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                          "the factory must build the model with no arguments") from None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("--model", f"{args.model} returned {type(model).__name__}, not an nn.Module")
    model.train()
    analysis = analyze_model(model, example)
    spec = analysis.spec
    spec.name = args.name or args.model.rpartition(":")[2]
    print(analysis.summary())
    if args.output:
        from lightning_autopar.files import atomic_write

        inputs = " ".join(f"--input {i}" for i in args.input)
        atomic_write(args.output, spec_yaml(spec, f"{spec.name}: written by\n  autopar analyze --model {args.model} "
                                            f"{inputs}\nper sample, forward, 4-byte elements (specs.UnitSpec)"))
        print(f"model spec written to {args.output}")
    return 0
