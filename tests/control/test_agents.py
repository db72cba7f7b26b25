"""A host's place in a job of several, and the one-line errors for a node that cannot take part."""
import pytest

from elaswave.config import ConfigError
from elaswave.control.agents import Node


def test_each_host_starts_its_own_share_of_the_founding_ranks():
    assert list(Node(2, 0, 2, "h:1").founding_ranks(4)) == [0, 1]
    assert list(Node(2, 1, None, "h:1").founding_ranks(4)) == [2, 3]
    assert list(Node().founding_ranks(6)) == list(range(6))
    assert Node(3, 2, 2, "[::1]:29500").endpoint() == ("::1", 29500)


def test_a_spare_host_starts_no_founding_rank_and_stands_by_with_as_many_as_a_training_host():
    training, spare = Node(3, 1, None, "h:1", spare_nodes=1), Node(3, 2, None, "h:1", spare_nodes=1)
    assert list(training.founding_ranks(4)) == [2, 3] and not training.is_spare
    assert spare.is_spare and list(spare.founding_ranks(4)) == [] and spare.workers(4) == 2
    spare.validate(4, "t")


@pytest.mark.parametrize("node, world, token, says", [
    (Node(0), 4, "t", "--nnodes=0 is invalid"),
    (Node(2, 2, None, "h:1"), 4, "t", "--node-rank=2 is invalid: with --nnodes=2 it is 0..1"),
    (Node(2, 1), 4, "t", "--nnodes=2 needs --rdzv-endpoint"),
    (Node(2, 1, None, "h"), 4, "t", "--rdzv-endpoint='h' is invalid"),
    (Node(2, 1, None, "h:70000"), 4, "t", "port in 1..65535"),
    (Node(3, 1, None, "h:1"), 4, "t", "the job's 4 ranks do not divide evenly"),
    (Node(2, 1, 3, "h:1"), 4, "t", "--nnodes=2 x --nproc-per-node=3 = 6 ranks is invalid: parallel.dp x parallel.pp x parallel.tp needs 4"),
    (Node(2, 1, None, "h:1"), 4, None, "ELASWAVE_TOKEN is not set"),
    (Node(2, 1, None, "h:1", spare_nodes=2), 4, "t", "--spare-nodes=2 is invalid with --nnodes=2: use 0..1"),
    (Node(3, 1, None, "h:1", spare_nodes=1), 5, "t",
     "--nnodes=3 less --spare-nodes=1 is invalid: the job's 5 ranks do not divide evenly over 2 hosts"),
])
def test_a_node_that_cannot_take_part_is_one_line(node, world, token, says):
    with pytest.raises(ConfigError, match=None) as err:
        node.validate(world, token)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_host_flags_default_to_torchruns_environment_as_kubeflow_sets_it(tmp_path):
    """PET_<FLAG>, as torchrun reads them (Kubeflow's PyTorchJob sets them); the store's endpoint
    from PET_MASTER_ADDR:PET_MASTER_PORT when no rendezvous endpoint is given."""
    from tests.helpers.spawn import TINY, run_cli
    job = [x for s in [*TINY, "parallel.timeout_s=3"] for x in ("--set", s)]
    wrong = run_cli(["run", *job], tmp_path, timeout_s=60,
                    env={"PET_NNODES": "2", "PET_NODE_RANK": "5", "ELASWAVE_TOKEN": "t"})
    assert wrong.returncode == 2 and "--node-rank=5 is invalid: with --nnodes=2 it is 0..1" in wrong.stderr, wrong.stderr
    nobody = run_cli(["run", *job], tmp_path, timeout_s=60,
                     env={"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": "9",
                          "ELASWAVE_TOKEN": "t"})
    assert nobody.returncode == 2 and "--rdzv-endpoint=127.0.0.1:9: no job's store answered" in nobody.stderr, \
        nobody.stderr
