"""Finding a run's checkpoints without touching them: the newest complete step, or a one-line refusal."""
from __future__ import annotations

import pathlib


class RunNotFoundError(FileNotFoundError):
    """A command reading a run found no complete checkpoint; it creates nothing and never substitutes the base model."""


def require_checkpoint(workdir, flag: str = "--checkpoint") -> int:
    """The newest complete checkpoint step of the run in `workdir`, read only; else RunNotFoundError naming `flag`."""
    workdir = pathlib.Path(workdir)
    if not (workdir / "checkpoints").is_dir():
        what = "no such directory" if not workdir.exists() else "no checkpoints/ folder in it"
        raise RunNotFoundError(f"{flag}={workdir}: {what}; {flag} names the workdir of a run "
                               "(e.g. runs/quickstart)")
    step = latest_checkpoint(workdir)
    if step is None:
        raise RunNotFoundError(f"{flag}={workdir}: {workdir / 'checkpoints'} holds no complete checkpoint")
    return step


def latest_checkpoint(workdir) -> int | None:
    """The newest complete checkpoint step in `workdir` (read only), or None."""
    from posttrain.checkpoints.orbax import Checkpointer

    if not (pathlib.Path(workdir) / "checkpoints").is_dir():
        return None
    with Checkpointer(pathlib.Path(workdir) / "checkpoints", every_steps=1, keep=1, read_only=True) as reader:
        return reader.latest_step()
