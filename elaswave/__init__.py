"""elaswave: elastic hybrid-parallel training on PyTorch. ``elaswave.train`` /
``elaswave.train_reference`` run a job from Python (see :mod:`elaswave.api`); the command line is
``elaswave``."""

__all__ = ["train", "train_reference", "job", "Run"]


def __getattr__(name: str):
    # Lazy: `import elaswave` stays cheap for the CLI and the worker processes.
    if name in __all__:
        from elaswave import api
        return getattr(api, name)
    raise AttributeError(f"module 'elaswave' has no attribute {name!r}")
