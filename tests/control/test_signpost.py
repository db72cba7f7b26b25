"""Where a job's store is now, asked at its hosts (elaswave.control.signpost): real TCPStores."""
import pytest

from elaswave.control import signpost
from elaswave.control.link import serve
from tests.helpers.spawn import free_port


def test_a_joiner_finds_the_store_itself_or_follows_a_signpost_to_one_that_answers():
    store = serve("127.0.0.1", 0, 5)
    here = f"127.0.0.1:{store.port}"
    # The store itself answers at the job's port: it is the store (no pointer there).
    assert signpost.find_store(["127.0.0.1"], store.port, within_s=1) == here
    # The first host is gone (nothing listens); the next one's agent points to where the store moved.
    post = signpost.Signpost(f"127.0.0.2:{free_port()}", here, timeout_s=5)
    port = int(post.addr.rsplit(":", 1)[1])
    assert signpost.find_store(["127.0.0.3", "127.0.0.2"], port, within_s=1) == here
    # A pointer to a store that does not answer leads nowhere: None once the time is up.
    post.point(f"127.0.0.1:{free_port()}")
    assert signpost.find_store(["127.0.0.2"], port, within_s=0.5) is None


def test_a_port_taken_here_means_no_signpost_not_an_error():
    store = serve("127.0.0.1", 0, 5)
    assert signpost.open_signpost(f"127.0.0.1:{store.port}", "h:1", timeout_s=5) is None
    assert signpost.open_signpost(None, "h:1", timeout_s=5) is None


@pytest.mark.parametrize("bad", ["x", ""])
def test_slurm_job_ids_that_are_not_numbers_are_one_line(bad):
    from elaswave.control import slurm
    from elaswave.errors import ConfigError
    with pytest.raises(ConfigError, match="is invalid: use the job's number"):
        slurm.job_endpoint(bad)
