"""Group names: one job's groups are never another job's, however their stores' ports repeat."""
from datetime import timedelta

import torch.distributed as dist

from elaswave.comm.groups import _prefix, job_tag
from elaswave.control import seal


def _job_store(token: str) -> tuple[dist.TCPStore, seal.Sealed]:
    raw = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=10))
    return raw, seal.open_job(raw, token)


def test_every_process_of_a_job_names_its_groups_alike_and_another_job_otherwise():
    raw_a, first = _job_store("t")
    joiner = seal.open_job(dist.TCPStore("127.0.0.1", raw_a.port, is_master=False, timeout=timedelta(seconds=10)),
                           "t", found=True)
    _, other = _job_store("t")  # the same token, another job (a new nonce)
    assert job_tag(first) == job_tag(joiner) != job_tag(other)
    assert len(job_tag(first)) == 12 and job_tag(seal.Sealed(raw_a, None)) == ""
    tag = job_tag(first)
    assert _prefix(tag, "sb", 0, (0, 1, 3)) == f"ew/grp/{tag}/sb/0/0-1-3/" != _prefix(job_tag(other), "sb", 0, (0, 1, 3))
    assert _prefix("", "ep", 2, (0, 1)) == "ew/grp/ep/2/0-1/"  # a job without a token (torchrun's own store)
