"""The control store on a real 3-member etcd cluster: the Store calls behave as TCPStore's (the
oracle, run beside it), a decision is one committed transaction whoever proposes it, gloo meets
through it, one member lost or frozen costs nothing, two lost leave no side able to decide, and
credentials (a user and password, or TLS client certificates) are enforced."""
import http.client
import json
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elaswave.control.etcd import RETRY_PAUSE_S, Credentials, EtcdAuthError, EtcdStore, Tls, parse_endpoints
from elaswave.control import rendezvous
from elaswave.control.rendezvous import role_commands
from elaswave.control.link import StoreLink, StoreLost
from elaswave.errors import ConfigError
from tests.helpers.certs import Authority
from tests.helpers.etcd import EtcdCluster, enable_auth, etcdctl


@pytest.fixture(scope="module")
def etcd():
    with EtcdCluster(3) as cluster:
        yield cluster


def _store(etcd, prefix: str, timeout_s: float = 10.0, **kw) -> EtcdStore:
    return EtcdStore(parse_endpoints(etcd.endpoints), prefix, timeout_s, **kw)


def _script(store) -> list:
    """Every call elaswave makes, with the answers a caller relies on."""
    out = [store.add("n", 3), store.add("n", 0), store.add("n", 2), store.add("fresh", 0)]
    store.set("a", "x")
    out += [store.get("a"), store.check(["a"]), store.check(["a", "nope"]), store.multi_get(["a", "n"])]
    out += [store.compare_set("epoch", "", "1"), store.compare_set("epoch", "", "9"),
            store.compare_set("epoch", "1", "2"), store.compare_set("epoch", "1", "3"),
            store.compare_set("absent", "5", "6"), store.check(["absent"])]
    store.set("b", b"\x00\xffbytes")
    out += [store.get("b"), store.delete_key("b"), store.check(["b"]), store.delete_key("b")]
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(seconds=0.3))
    return out


def test_every_call_answers_as_tcpstore_does(etcd):
    tcp = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=10))
    assert _script(_store(etcd, "/t/script/")) == _script(tcp)


def test_of_rival_proposals_for_an_epoch_exactly_one_commits_whichever_member_each_reached(etcd):
    # Each proposer talks to a different member first: the transaction, not the member, decides.
    stores = []
    for i in range(6):
        s = _store(etcd, "/t/rival/")
        s._at = i % 3
        stores.append(s)
    stores[0].set("epoch", "1")
    seen = [None] * len(stores)
    barrier = threading.Barrier(len(stores))

    def propose(i):
        barrier.wait()
        seen[i] = stores[i].compare_set("epoch", "1", f"2 by {i}")
    threads = [threading.Thread(target=propose, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(set(seen)) == 1 and seen[0].startswith(b"2 by ")
    # ... and a counter bumped through every member at once counts each add exactly once.
    adds = [0] * len(stores)

    def bump(i):
        for _ in range(10):
            stores[i].add("counter", 1)
        adds[i] = 10
    threads = [threading.Thread(target=bump, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert stores[0].add("counter", 0) == sum(adds) == 60


def test_a_wait_follows_the_watch_and_wakes_when_the_key_is_set(etcd):
    waiter, writer = _store(etcd, "/t/wait/"), _store(etcd, "/t/wait/")
    threading.Timer(0.3, lambda: writer.set("alert/1", "x")).start()
    began = time.monotonic()
    waiter.wait(["alert/1"], timedelta(seconds=20))
    assert 0.25 < time.monotonic() - began < 2.0


def test_gloo_meets_through_the_etcd_store(etcd):
    base = _store(etcd, "/t/gloo/")
    out = [None, None]

    def rank(r):
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", base.clone()), r, 2, timedelta(seconds=30))
        t = torch.tensor([float(r + 1)])
        pg.allreduce([t]).wait()
        out[r] = t.item()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == [3.0, 3.0]


def test_a_leader_lost_is_an_election_not_a_lost_store_whatever_the_heartbeat_timeout():
    """The link's grace is at least what the cluster takes to replace its leader (etcd says its
    election timeout through the least lease TTL it grants: 2 s at the tests' 1 s timeout). With
    the 2 s heartbeat timeout alone, a rank whose requests met the election stopped (the partition
    matrix's refusing cut, 1 run in 20) while its side held the majority. Here the leader freezes
    (as behind a cut: its peers hear nothing) and every round of requests fails fast."""
    with EtcdCluster(3) as etcd:
        store = _store(etcd, "/t/election/", request_timeout_s=0.3)
        assert store.leader_change_s() == 6.0  # ceil(1.5 x 1 s) = 2 s, three times
        link = rendezvous.link(store, timeout_s=10, grace_s=0.3)
        link.set("epoch", "1")
        leader = etcd.leader()
        etcd.stop(leader)
        try:
            began = time.monotonic()
            assert link.compare_set("epoch", "1", "2") == b"2"  # answered once the two elect a leader
            assert 0.3 < time.monotonic() - began < link.grace_s
        finally:
            etcd.cont(leader)


def test_one_member_lost_or_frozen_costs_nothing_and_two_lost_leave_nobody_able_to_decide():
    with EtcdCluster(3) as etcd:
        # Through a link, as the runtime calls it: a leader's election (~1 s here) is within its grace.
        store = _store(etcd, "/t/quorum/", request_timeout_s=1.0)
        link = StoreLink(store, None, timeout_s=10, grace_s=5.0)
        link.set("epoch", "1")
        for fault, before, after in [(etcd.stop, "1", "2"), (etcd.kill, "2", "3")]:
            # member 0 frozen (SIGSTOP: its kernel still accepts, nothing answers), then member 1 killed
            fault(0 if fault == etcd.stop else 1)
            began = time.monotonic()
            assert link.compare_set("epoch", before, after) == after.encode()
            # Answered, not lost: the link raises StoreLost past its 5 s grace, so the answer is the
            # claim. The wall bound only catches a hang (a loaded CI took 5.2 s through an election).
            assert time.monotonic() - began < 15
            etcd.cont(0)
        etcd.kill(2)  # one of three left: no majority
        began = time.monotonic()
        with pytest.raises(StoreLost, match="has not answered for 5 s"):
            link.compare_set("epoch", "3", "4")
        assert time.monotonic() - began < 15
        with pytest.raises(dist.DistNetworkError):
            store.clone().get("epoch")  # nor can it read: reads are linearizable


class _Counting(EtcdStore):
    """The real client, counting the connections it opens (one per member and round)."""
    opened = 0

    def _connection(self, host, port, timeout_s):
        type(self).opened += 1
        return super()._connection(host, port, timeout_s)


def test_members_that_fail_at_once_are_not_asked_in_a_tight_loop():
    # A member gone fails a connect in microseconds (refused here; ENETUNREACH on a host cut off by
    # a blackhole route): a cut-off rank's link and watch stream retried that in a tight loop,
    # 60-70 % of a core each.
    with EtcdCluster(1) as etcd:
        store = _Counting(parse_endpoints(etcd.endpoints), "/t/spin/", 10.0)
        halt = threading.Event()
        store.follow("/", lambda *event: None, halt)
        time.sleep(0.5)
        etcd.kill(0)
        began, before = time.monotonic(), _Counting.opened
        with pytest.raises(StoreLost):
            StoreLink(store, None, timeout_s=10, grace_s=1.0).get("x")
        spent = time.monotonic() - began
        halt.set()
    # The link's rounds and the stream's tries, each at most one per RETRY_PAUSE_S (and one more).
    most = 2 * (spent / RETRY_PAUSE_S + 2)
    assert _Counting.opened - before <= most, f"{_Counting.opened - before} connections in {spent:.2f} s"


def _post(etcd, path, body, token=None):
    conn = http.client.HTTPConnection(*etcd.endpoint(0), timeout=10)
    conn.request("POST", path, json.dumps(body), {"Authorization": token} if token else {})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def test_a_cluster_with_auth_admits_only_the_jobs_credentials():
    with EtcdCluster(3) as etcd:
        for path, body in [("/v3/auth/role/add", {"name": "root"}),
                           ("/v3/auth/user/add", {"name": "root", "password": "root-pw"}),
                           ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                           ("/v3/auth/user/add", {"name": "job", "password": "job-pw"}),
                           ("/v3/auth/role/add", {"name": "elaswave"}),
                           ("/v3/auth/role/grant", {"name": "elaswave", "perm": {
                               "key": "L2pvYi8=", "range_end": "L2pvYjA=", "permType": "READWRITE"}}),
                           ("/v3/auth/user/grant", {"user": "job", "role": "elaswave"}),
                           ("/v3/auth/enable", {})]:
            status, body = _post(etcd, path, body)
            assert status == 200, (path, body)
        good = _store(etcd, "/job/", credentials=Credentials("job", "job-pw"))
        good.set("epoch", "1")
        assert good.get("epoch") == b"1"
        for who, needle in [(None, "user name is empty"), (Credentials("job", "a-guess"), "authentication failed"),
                            (Credentials("job", "job-pw"), "permission denied")]:
            prefix = "/elsewhere/" if who is not None and who.password == "job-pw" else "/job/"
            with pytest.raises(EtcdAuthError, match=needle):
                _store(etcd, prefix, credentials=who).set("epoch", "2")
        assert good.get("epoch") == b"1"


def test_a_cluster_on_tls_admits_only_a_client_certificate_its_ca_signed(tmp_path):
    ca, other_ca = Authority(tmp_path / "pki", "ca"), Authority(tmp_path / "pki", "other-ca")
    server = ca.issue("member", ip="127.0.0.1")
    job, stranger, expired = ca.issue("job"), other_ca.issue("stranger"), ca.issue("expired", days=0)
    with EtcdCluster(3, tls=(ca.cert, *server)) as etcd:
        good = _store(etcd, "/job/", tls=Tls(str(ca.cert), *map(str, job)))
        _script(good)  # every call, the watch stream included, over HTTPS
        assert good.compare_set("decided", "", "yes") == b"yes" and good.clone().get("decided") == b"yes"
        for tls, needle in [(None, "serves HTTPS\\? set ELASWAVE_ETCD_CACERT"),
                            (Tls(str(other_ca.cert), *map(str, job)), "does not verify against ELASWAVE_ETCD_CACERT"),
                            (Tls(str(ca.cert)), "refused the TLS client certificate"),
                            (Tls(str(ca.cert), *map(str, stranger)), "refused the TLS client certificate"),
                            (Tls(str(ca.cert), *map(str, expired)), "refused the TLS client certificate")]:
            began = time.monotonic()
            with pytest.raises(EtcdAuthError, match=needle):
                _store(etcd, "/job/", tls=tls).set("decided", "no")
            assert time.monotonic() - began < 10
        assert good.get("decided") == b"yes"
    with pytest.raises(ConfigError, match="ELASWAVE_ETCD_CACERT='/no/such.pem' is invalid: no such file"):
        Tls("/no/such.pem").context()


def test_with_tls_and_auth_the_role_elaswave_prints_is_all_a_job_needs_and_nobody_else_can_revoke_its_lease(tmp_path):
    """A 3-member cluster on TLS with auth on; the job's user made by running the etcdctl commands
    `elaswave etcd-role` prints, as printed. The job's user does all a job does under its prefix
    (keys, a transaction, a lease bound to a key, its renewal and time to live, the watch stream);
    a client without credentials, and another user of the cluster, can neither read the job's keys
    nor revoke its lease (before auth, any client could, and the rank looked dead)."""
    ca = Authority(tmp_path / "pki", "ca")
    server = ca.issue("member", ip="127.0.0.1")
    with EtcdCluster(3, tls=(ca.cert, *server), client_cert_auth=False) as etcd:
        root = enable_auth(etcd, "root-pw")
        etcdctl(etcd, *role_commands("j1", "job"), user=root, env={"ELASWAVE_ETCD_PASSWORD": "job-pw"})
        etcdctl(etcd, *role_commands("other", "stranger"), user=root, env={"ELASWAVE_ETCD_PASSWORD": "x-pw"})
        tls = Tls(str(ca.cert))  # the members' CA: the password goes over HTTPS
        job = _store(etcd, "/elaswave/j1/1/", tls=tls, credentials=Credentials("job", "job-pw"))
        _script(job)  # every call, the watch stream included
        lease, _ = job.grant(5)
        job.put_leased("ew/alive/0", "{}", lease)
        assert job.keep_alive(lease) > 0 and job.lease_left(lease) > 0
        for who, needle in [(None, "user name is empty"), (Credentials("stranger", "x-pw"), "permission denied")]:
            outsider = _store(etcd, "/elaswave/j1/1/", tls=tls, credentials=who)
            with pytest.raises(EtcdAuthError, match=needle):
                outsider.revoke(lease)
            with pytest.raises(EtcdAuthError, match=needle):
                outsider.get("a")
        assert job.lease_left(lease) > 0 and job.get("ew/alive/0") == b"{}"
        job.revoke(lease)  # the job's own user may


@pytest.mark.parametrize("text", ["", "host", "h:0", "h:1,h2", "h:99999"])
def test_bad_endpoints_are_one_line_naming_the_value(text):
    with pytest.raises(ConfigError, match="--rdzv-endpoint=.* is invalid"):
        parse_endpoints(text)
