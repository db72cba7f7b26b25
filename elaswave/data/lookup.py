"""``elaswave data batches``: which samples a micro-batch held -- what people look up after a loss
spike. The answer comes from the job's config alone (the sampler is a pure function of the id), so
it is the same whichever layout, failures or restarts the run went through."""
from __future__ import annotations

from collections.abc import Iterator

from elaswave.config import JobConfig
from elaswave.errors import ConfigError


def parse_steps(text: str) -> range:
    """``A:B`` (steps A..B-1) or ``A`` (that step alone)."""
    try:
        first, _, last = text.partition(":")
        steps = range(int(first), int(last) if last else int(first) + 1)
    except ValueError:
        steps = range(0)
    if not steps or steps.start < 0:
        raise ConfigError(f"--steps={text!r} is invalid: give A:B with 0 <= A < B (steps A..B-1), or one step A")
    return steps


def batches(cfg: JobConfig, steps: range, with_text: bool = False) -> Iterator[dict]:
    """One record per micro-batch of ``steps``: each sample's data epoch, window, and where its first
    token is (source of a mixture, shard, document, offset in it); with ``with_text``, the window decoded."""
    from elaswave.data.sampler import open_sampler
    from elaswave.model.registry import model_for

    sampler = open_sampler(cfg, model_for(cfg))
    paths = [p for p, _ in cfg.data.mixture] if cfg.data.mix else [cfg.data.path]
    decoders = [t.encoder().decode for t in sampler.sources] if with_text else None
    for step in steps:
        for m in range(cfg.train.num_micro_batches):
            d = sampler.draw(step, m)
            samples = []
            for sample, s, e, w in zip(sampler.samples(step, m).tolist(), d.sources.tolist(), d.epochs.tolist(),
                                       d.windows.tolist()):
                start, tokens = w * sampler.seq_len, sampler.sources[s]
                shard, doc, offset = tokens.locate(start)
                one = {"sample": sample, "epoch": e, "window": w, "token": start,
                       "shard": shard, "document": doc, "offset": offset}
                if cfg.data.mix:
                    one["source"] = paths[s]
                if decoders is not None:
                    one["text"] = decoders[s](tokens.read(start, sampler.seq_len + 1))
                samples.append(one)
            yield {"step": step, "micro_batch": m, "samples": samples}
