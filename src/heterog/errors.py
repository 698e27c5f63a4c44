"""Typed errors. User mistakes raise a subclass of HeterogError whose message says what is
wrong, where, and how to fix it; the CLI prints it as one paragraph (traceback with --debug).
Broken internal invariants are plain asserts."""

from __future__ import annotations

import difflib


class HeterogError(Exception):
    """Base of every error meant for the user."""


class ModelError(HeterogError):
    """Unknown zoo model, failing factory, bad model arguments or example inputs."""


class GraphError(HeterogError):
    """A malformed OpGraph (file or in memory)."""


class ClusterError(HeterogError):
    """A malformed cluster spec or an unknown GPU type."""


class PlanError(HeterogError):
    """A malformed or inconsistent Plan."""


class InfeasibleError(HeterogError):
    """No deployment fits in the cluster's memory."""


class ArtifactError(HeterogError):
    """A JSON artifact that cannot be read: wrong kind, version or syntax."""


class DataError(HeterogError):
    """A user data loader (`--data path/file.py:loader`) that cannot be used."""


class TrainingError(HeterogError):
    """Training options (learning rate, schedule, clipping, accumulation, evaluation) or the
    user's optimizer / scheduler / evaluate functions that cannot be used."""


class CheckpointError(HeterogError):
    """A checkpoint folder that is missing, incomplete or does not fit the model."""


class ResourceError(HeterogError):
    """This machine lacks what the run needs (memory, processes); --force overrides."""


class HeterogWarning(UserWarning):
    """Something suspicious but usable (e.g. an implausible cluster figure); the CLI prints
    it as one line starting 'warning:'."""


class RankError(HeterogError):
    """A distributed rank failed or hung. Carries the rank so the message survives pickling."""

    def __init__(self, rank: int, message: str):
        super().__init__(rank, message)
        self.rank = rank
        self.message = message

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.message}"


def did_you_mean(name: str, known) -> str:
    """' Did you mean X?' when `name` is close to one of `known` (a typo; case ignored), else
    '' — the sentence an unknown model, cluster or strategy name adds to its error."""
    lowered = {str(k).lower(): str(k) for k in known}
    close = difflib.get_close_matches(str(name).lower(), list(lowered), n=2, cutoff=0.6)
    if not close:
        return ""
    return f" Did you mean {' or '.join(repr(lowered[c]) for c in close)}?"
