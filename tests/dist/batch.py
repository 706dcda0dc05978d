"""Many scenario files' scenarios in one torchrun launch (tests/conftest.py's batches, one per world size).

Usage: torchrun --nproc-per-node N tests/dist/batch.py OUT_DIR script:name[,script:name...]
Scenario ``name`` of ``script`` (a tests/dist file whose ``run(out, name)`` the scenarios' ``main`` drives) runs as
that file's own launch would run it, writing into OUT_DIR/<script stem>/. Before it, rank 0 writes
OUT_DIR/_progress/<stem>.<name>.started, after it each rank .done_r<rank>, so the launcher can blame a scenario the launch died or
hung in and relaunch the ones not run; a launch torchrun restarts (--max-restarts) skips the scenarios every
rank finished. Each scenario starts from the same state: seeds reset, the environment and
working directory as the launch began (a scenario may set a variable for itself).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


def run_one(out: Path, script: str, name: str) -> None:
    import lightning.pytorch as L

    from scenarios import record

    stem = Path(script).stem
    where = out / stem
    progress = out / "_progress"
    where.mkdir(parents=True, exist_ok=True)
    progress.mkdir(exist_ok=True)
    if _rank() == 0:
        (progress / f"{stem}.{name}.started").touch()
    env, cwd = dict(os.environ), os.getcwd()
    L.seed_everything(0, verbose=False)
    try:
        importlib.import_module(stem).run(where, name)
    except BaseException:
        text = traceback.format_exc()
        record(where, name, crash=text)
        (progress / f"{stem}.{name}.crash_r{_rank()}.txt").write_text(text)
        print(f"rank {_rank()} {script}:{name} failed:\n{text}", file=sys.stderr, flush=True)
        # other ranks may wait in a collective of this scenario: end the launch (the launcher relaunches the rest)
        os._exit(1)
    finally:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
    (progress / f"{stem}.{name}.done_r{_rank()}").touch()  # every rank's: one rank may be ahead of another


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ.get("WORLD_SIZE", 1))
    items = sys.argv[2].split(",")
    # the scenario files and what they import (Lightning, transformers, ...) load before the first scenario, with
    # no collection while they do: their objects are never garbage, and full collections over the growing heap
    # cost ~1 s per process; settled() then freezes them
    gc.disable()
    for stem in dict.fromkeys(Path(item.split(":", 1)[0]).stem for item in items):
        importlib.import_module(stem)
    gc.enable()
    from common import settled

    for item in settled(items):
        script, name = item.split(":", 1)
        marks = out / "_progress" / f"{Path(script).stem}.{name}"
        if len(list(marks.parent.glob(f"{marks.name}.done_r*"))) == world:
            continue  # finished by every rank before torchrun restarted the launch (--max-restarts)
        run_one(out, script, name)


if __name__ == "__main__":
    main()
