"""Silent data corruption, injected (the ``flip`` fault of :mod:`elaswave.control.faults`): the
lowest bit of one value of this rank's state, which only the end-of-run state check can see."""
from __future__ import annotations

import torch

from elaswave.errors import ConfigError


def flip_low_bit(st, what: str) -> None:
    """``moment``: the first Adam moment this rank owns; ``param``: its first parameter;
    ``replica``: see :func:`_replica_values`."""
    if what == "moment":
        b = next(i for i, b in enumerate(st.optimizer.buckets) if b.owned)
        values = [st.optimizer.state[b][1, st.optimizer.buckets[b].owned[0].slot_offset:][:1]]
    elif what == "replica":
        values = _replica_values(st)
    else:
        values = [st.stage.layers[0].flat[:1]]
    for value in values:
        bits = value.view(torch.int16 if value.dtype == torch.bfloat16 else torch.int32)
        bits ^= 1


def _replica_values(st) -> list[torch.Tensor]:
    """The first value this rank holds of a tensor its device's other shards hold too (a norm
    weight, say: the model's ``replicas``), in its parameters and, where it owns that chunk, its
    master: a shard whose replica drifted, consistent with itself and with its slice's holders."""
    if st.shards is None:
        raise ConfigError("elastic.inject flip what=replica is invalid: it needs parallel.tp > 1")
    st.optimizer.settle()
    for layer in st.stage.layers:
        spans = st.shards.model.replicas(layer)
        if spans:
            offset = min(o for o, _ in spans.values())
            break
    else:
        raise ConfigError("elastic.inject flip what=replica is invalid: this rank holds no replicated tensor")
    values = [layer.flat[offset:offset + 1]]
    for b, state in zip(st.optimizer.buckets, st.optimizer.state):
        for oc in b.owned:
            start = oc.chunk * b.chunk_numel
            if oc.layer == layer.index and start <= offset < start + oc.numel:
                values.append(state[0, oc.slot_offset + offset - start:][:1])
    return values
