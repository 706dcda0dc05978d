"""File helpers of the callbacks: JSON published atomically (``lightning_autopar.files``)."""

from __future__ import annotations

import json
import os
from typing import Any

from lightning_autopar.files import atomic_file


def write_json(path: str | os.PathLike, data: Any) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
