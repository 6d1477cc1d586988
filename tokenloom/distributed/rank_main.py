"""The entry point of a rank started on this machine (rank_process.py): ``python -m
tokenloom.distributed.rank_main ARGS``, ARGS a pickle of worker.worker_main's keyword arguments.
A fresh interpreter that imports tokenloom only, never the script that started rank 0."""

from __future__ import annotations

import pickle
import sys


def main(argv: list[str]) -> None:
    with open(argv[1], "rb") as f:
        kwargs = pickle.load(f)
    from tokenloom.distributed.worker import worker_main

    worker_main(**kwargs)


if __name__ == "__main__":
    main(sys.argv)
