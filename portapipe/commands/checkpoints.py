"""``portapipe checkpoints DIR``: a folder's checkpoints as JSON.

DIR is a run folder (``log.dir``; its ``checkpoints/`` is listed) or a checkpoint folder
(``checkpoint.dir``). Prints one JSON list, oldest first: each checkpoint's path, step, run id,
the layout it was written with, whether it is complete, and if not, why not (each one is checked
in full: manifest, every part's size and checksum, every rank's run id and step). Exit 2 when DIR
does not exist.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import list_checkpoints

    folder = Path(args.dir)
    if not folder.is_dir():
        print(f"portapipe: {folder} is not a folder (give a log.dir or a checkpoint.dir)", file=sys.stderr)
        return 2
    print(json.dumps(list_checkpoints(folder), indent=1))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("checkpoints", help="list a folder's checkpoints as JSON: step, run, layout, complete or why not")
    p.add_argument("dir", help="a run folder (log.dir) or a checkpoint folder (checkpoint.dir)")
    p.set_defaults(func=run)
