"""`offloop relay` in a process of its own, between a real publisher and control server
(this process) and real subscribers and control clients."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from helpers.figures import memory, report
from helpers.waiting import wait_until

from offloop.bus import (
    ControlClient,
    ControlServer,
    Publisher,
    PublisherSilent,
    RunInfo,
    Subscriber,
    find_run,
    read_run_info,
    write_run_info,
)
from offloop.bus.relay import Relay
from offloop.bus.security import SecurityError, generate_keys, load_client_keys, load_server_keys
from offloop.bus.wire import decode_reply, encode_request

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def a_run(tmp_path, keys=None, relay_key="relay"):
    """A publisher and control server with run.json, as a trainer's rank 0 has them."""
    ctx = zmq.Context()
    server_keys = load_server_keys(keys) if keys else None
    auth = server_keys.start_authenticator(ctx) if server_keys else None
    pub = Publisher("relayed-run", heartbeat_interval=0.1, context=ctx, curve=server_keys)
    endpoints = pub.start()
    pub.set_config({"model": "mlp"})
    control = ControlServer(context=ctx, curve=server_keys)
    endpoints["control"] = control.start()
    run_dir = tmp_path / "runs" / "relayed"
    info = RunInfo(pub.run_id, "relayed", os.getpid(), time.time(), endpoints,
                   curve_public=server_keys.public.decode() if server_keys else "")
    write_run_info(run_dir, info)
    pub.run_info = info.to_dict()
    try:
        yield pub, control, run_dir
    finally:
        pub.close(linger=0.3)
        control.close()
        if auth is not None:
            auth.stop()
        ctx.term()


@contextlib.contextmanager
def a_relay(run_dir, announce, *args):
    """`offloop relay RUN_DIR --announce ROOT`, once its announced run.json names it."""
    proc = subprocess.Popen([sys.executable, "-m", "offloop.cli", "relay", str(run_dir), "--announce",
                             str(announce), "--heartbeat-timeout", "2", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT.parent)
    try:
        path = announce / read_run_info(run_dir).run_name / "run.json"
        wait_until(lambda: path.exists() or proc.poll() is not None, 30, "the relay to announce itself")
        if proc.poll() is not None:
            raise AssertionError(f"the relay exited: {proc.communicate()[1]}")
        yield proc, read_run_info(path.parent)
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.communicate(timeout=15)


@contextlib.contextmanager
def acking(control, **result):
    """The trainer's side: every request that reaches `control` is acked with `result`."""
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            for request in control.poll():
                request.ack(**result)
            time.sleep(0.005)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def drain(sub, published, beats=4, timeout=60.0):
    """What `sub` delivers until it has accounted for `published` events (received or
    counted lost), then while `beats` more heartbeats come (0.1 s apart, each counting
    tail loss once 0.3 s old): anything counted twice would show by then."""
    got, target = [], None
    deadline = time.monotonic() + timeout
    while target is None or sub.stats.heartbeats < target:
        if target is None and sub.stats.received + sub.stats.gaps >= published:
            target = sub.stats.heartbeats + beats
        if time.monotonic() > deadline:
            raise AssertionError(f"{sub.stats} after {timeout}s; {published} published")
        msg = sub.recv(timeout=0.05)
        if msg is not None:
            got.append(msg)
    return got


def test_every_event_reaches_monitors_through_the_relay_with_late_join_state_and_info(tmp_path):
    with a_run(tmp_path) as (pub, _, run_dir):
        pub.hold(0.005)
        for batch in range(1, 51):  # before anyone joins: the state has the latest of these
            pub.publish("batch_end", (0, batch, batch, batch, 0), {"loss": 1.0 / batch})
        pub.release()
        with a_relay(run_dir, tmp_path / "announced") as (relay, relayed):
            upstream = read_run_info(run_dir).endpoints
            assert set(relayed.endpoints) == {"events", "state", "control"}
            assert not set(relayed.endpoints.values()) & set(upstream.values())
            asked = find_run(relayed.endpoints["state"])  # info through the relay names the relay
            assert asked.endpoints == relayed.endpoints and asked.run_id == pub.run_id
            assert asked.extra["relayed_from"] == upstream["state"]
            every = Subscriber(relayed.endpoints["events"], relayed.endpoints["state"], settle=0.3)
            one = Subscriber(relayed.endpoints["events"], relayed.endpoints["state"], topics=["batch_end"],
                             settle=0.3)
            with every, one:
                joined = every.connect(join_timeout=10)
                one.connect(join_timeout=10)
                assert joined.run == pub.run_id and joined.config == {"model": "mlp"}
                assert [e.data["loss"] for e in joined.entries if e.topic == "batch_end"] == [1.0 / 50]
                for batch in range(51, 2051):
                    pub.publish("batch_end", (0, batch, batch, batch, 0), {"loss": 1.0 / batch})
                    pub.release_due()
                pub.release()
                for sub in (every, one):
                    live = [m.tseq for m in drain(sub, 2000) if not m.from_state]
                    assert sub.stats.duplicates == 0 and sub.stats.malformed == 0
                    # 50 was in the state; every later one arrives or is counted lost, exactly once
                    assert sub.stats.received + sub.stats.gaps == 2000
                    assert live == sorted(set(live)) and live[-1] == 2050
                    # the only loss allowed: events sent before the relay's subscription reached
                    # the trainer, at the start (a topic new to the relay), counted
                    assert live[0] == 51 + sub.stats.gaps and len(live) == 2050 - live[0] + 1
                    assert sub.stats.heartbeats > 0  # the trainer's own, through the relay


def test_a_monitor_that_stops_reading_counts_exactly_what_the_relays_queue_dropped(tmp_path):
    with a_run(tmp_path) as (pub, _, run_dir):
        with a_relay(run_dir, tmp_path / "announced", "--subscriber-hwm", "50") as (relay, relayed):
            with Subscriber(relayed.endpoints["events"], topics=["pad"], rcvhwm=10, settle=0.3) as slow:
                slow.connect(join_timeout=10)
                wait_until(lambda: "pad" in pub.interest.in_bursts, 10, "the subscription to reach the trainer")
                pad = b"x" * (64 << 10)
                for i in range(3000):  # far more than the relay's queue, both TCP buffers and ours
                    pub.publish("pad", (0, i, i, i, 0), {"pad": pad})
                published = pub.topic_seq("pad")
                drain(slow, published)
                assert slow.stats.gaps > 0  # something was lost, and counted
                assert slow.stats.received + slow.stats.gaps == published
                assert slow.stats.duplicates == 0


def test_control_through_the_relay_is_applied_once_and_acked(tmp_path):
    with a_run(tmp_path) as (pub, control, run_dir):
        with a_relay(run_dir, tmp_path / "announced") as (relay, relayed):
            with ControlClient(relayed.endpoints["control"], client_id="monitor-1") as client, \
                    acking(control, step=7, epoch=0):
                ack = client.halt("through the relay", timeout=15)
            assert ack.ok and ack.result == {"step": 7, "epoch": 0}
            assert control.stats.received == 1 and control.stats.acked == 1
            # a retry of the same request, through the relay, gets the stored ack, not a second halt
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.linger = 0
            try:
                dealer.connect(relayed.endpoints["control"])
                dealer.send(encode_request("ctl", client="monitor-1", req=ack.req, op="halt",
                                           args={"reason": "through the relay"}, t=time.time()))
                assert dealer.poll(10_000), "no answer to the retry"
                again = decode_reply(dealer.recv())
            finally:
                dealer.close()
            assert again["ok"] and again["result"] == {"step": 7, "epoch": 0}
            assert control.stats.duplicates == 1 and control.poll() == []


def test_the_trainer_answers_a_relayed_envelope_and_refuses_other_layouts(tmp_path):
    with a_run(tmp_path) as (pub, control, run_dir), acking(control, step=1):
        ctx = zmq.Context.instance()
        for endpoint, counter in ((pub.endpoints["state"], lambda: pub.stats.bad_requests),
                                  (control.endpoint, lambda: control.stats.malformed)):
            dealer = ctx.socket(zmq.DEALER)
            dealer.linger = 0
            try:
                dealer.connect(endpoint)
                body = (encode_request("info_req") if endpoint == pub.endpoints["state"] else
                        encode_request("ctl", client="c", req=1, op="halt", args={"reason": ""}, t=0.0))
                dealer.send_multipart([b"client-7", b"", body])  # as the relay sends it
                assert dealer.poll(10_000)
                frames = dealer.recv_multipart()
                assert frames[:2] == [b"client-7", b""]  # routed back through the envelope
                assert decode_reply(frames[2])["k"] in ("info", "ack")
                before = counter()
                dealer.send_multipart([b"client-7", body])  # no delimiter: no layout the servers serve
                wait_until(lambda counter=counter, before=before: counter() > before, 10, "the refusal")
            finally:
                dealer.close()


@pytest.fixture
def keys(tmp_path):
    folder = tmp_path / "keys"
    generate_keys(folder, "relay", role="control")  # the trainer admits the relay
    generate_keys(folder, "watcher", role="monitor")  # the relay admits these two
    generate_keys(folder, "operator", role="control")
    generate_keys(tmp_path / "strangers", "stranger")
    return folder


def test_with_keys_the_relay_admits_only_its_keys_and_a_monitor_key_cannot_halt(tmp_path, keys):
    with a_run(tmp_path, keys=keys) as (pub, control, run_dir):
        with a_relay(run_dir, tmp_path / "announced", "--keys", str(keys)) as (relay, relayed):
            assert relayed.curve_public
            watcher = load_client_keys(keys, "watcher", relayed.curve_public)
            with Subscriber(relayed.endpoints["events"], relayed.endpoints["state"], curve=watcher) as sub:
                assert sub.connect(join_timeout=10).run == pub.run_id
            with ControlClient(relayed.endpoints["control"], client_id="w", curve=watcher) as client:
                ack = client.halt("a monitor may not", timeout=15)
            assert not ack.ok and "refused by the relay" in ack.error and "monitor" in ack.error
            assert control.stats.received == 0  # it never reached the trainer

            operator = load_client_keys(keys, "operator", relayed.curve_public)
            with ControlClient(relayed.endpoints["control"], client_id="o", curve=operator) as client, \
                    acking(control, step=3):
                ack = client.halt("an operator may", timeout=15)
            assert ack.ok and ack.result == {"step": 3}

            stranger = load_client_keys(tmp_path / "strangers", "stranger", relayed.curve_public)
            with Subscriber(relayed.endpoints["events"], relayed.endpoints["state"], curve=stranger) as sub:
                with pytest.raises(PublisherSilent):
                    sub.connect(join_timeout=2)


def test_a_run_with_keys_is_refused_a_relay_without_a_key_for_it(tmp_path, keys):
    with a_run(tmp_path, keys=keys) as (_, _, run_dir):
        done = subprocess.run([sys.executable, "-m", "offloop.cli", "relay", str(run_dir)],
                              capture_output=True, text=True, timeout=60, cwd=ROOT.parent)
    assert done.returncode == 2
    assert "has keys" in done.stderr and "--keys" in done.stderr


def test_a_relay_never_offers_less_than_its_run_it_needs_keys_of_its_own_for_a_run_with_keys(
        tmp_path, keys):
    with a_run(tmp_path, keys=keys) as (_, control, run_dir):
        info = read_run_info(run_dir)
        upstream = load_client_keys(keys, "relay", info.curve_public)
        with pytest.raises(SecurityError, match=r"run relayed has keys.*--keys DIR"):
            Relay(info, upstream=upstream)  # the library refuses it, for every bridge built on it
        with pytest.raises(SecurityError, match=r"--keys DIR"):  # a client key says the run has keys
            Relay(RunInfo.from_dict({**info.to_dict(), "curve_public": ""}), upstream=upstream)
        for extra in ([], ["--insecure"], ["--host", "0.0.0.0", "--insecure"]):
            done = subprocess.run([sys.executable, "-m", "offloop.cli", "relay", str(run_dir),
                                   "--upstream-keys", str(keys), "--announce", str(tmp_path / "a"),
                                   *extra], capture_output=True, text=True, timeout=60,
                                  cwd=ROOT.parent, env={k: v for k, v in os.environ.items()
                                                        if k != "OFFLOOP_KEYS"})
            assert done.returncode == 2, (extra, done.stderr)
            [line] = done.stderr.strip().splitlines()  # one line, no traceback
            assert line.startswith("offloop: error: run relayed has keys") and "--keys DIR" in line
        assert not (tmp_path / "a").exists() and control.stats.received == 0


def test_the_relay_exits_once_the_run_has_finished_and_marks_its_announcement(tmp_path):
    with a_run(tmp_path) as (pub, _, run_dir):
        with a_relay(run_dir, tmp_path / "announced") as (relay, _):
            pub.close(linger=0.3)  # final heartbeats
            relay.wait(timeout=30)
            assert relay.returncode == 0
        assert read_run_info(tmp_path / "announced" / "relayed").finished


def test_with_keys_the_longest_topic_is_subscribed_through_the_relay(tmp_path, keys):
    # the events sockets cut a frame past MAX_SUBSCRIPTION_BYTES: CURVE's handshake and
    # its encrypted subscription frames, the longest topic's included, must fit under it
    from offloop.bus.wire import MAX_TOPIC_BYTES

    longest = "t" * MAX_TOPIC_BYTES
    with a_run(tmp_path, keys=keys) as (pub, _, run_dir):
        info = read_run_info(run_dir)
        server = load_server_keys(keys)
        with Relay(info, keys=server, upstream=load_client_keys(keys, "relay", info.curve_public)) as relay:
            watcher = load_client_keys(keys, "watcher", server.public.decode())
            with Subscriber(relay.endpoints["events"], topics=[longest], curve=watcher) as sub:
                sub.connect()

                def served() -> bool:
                    pub.publish(longest, (0, 1, 1, 1, 0), {"i": 1})
                    return sub.recv(timeout=0.05) is not None

                wait_until(served, 10, "the longest topic through the relay, with keys")


def test_with_keys_a_monitor_key_asking_too_many_subscriptions_is_cut_at_the_trainer_and_the_relay(
        tmp_path, keys):
    # issue 44: a run with keys caps what each connection files (subscription_cap); a
    # relay passes on at most what the trainer lets one connection have, so the trainer
    # never cuts the relay, and the monitor behind it is served
    from offloop.bus.subscription_cap import PER_PEER

    with a_run(tmp_path, keys=keys) as (pub, _, run_dir):
        info = read_run_info(run_dir)
        server = load_server_keys(keys)
        ctx = zmq.Context()
        floods = []
        try:
            with Relay(info, keys=server, upstream=load_client_keys(keys, "relay", info.curve_public),
                       context=ctx) as relay:
                watcher = load_client_keys(keys, "watcher", server.public.decode())
                with Subscriber(relay.endpoints["events"], topics=["batch_end"], curve=watcher) as sub:
                    sub.connect()
                    for endpoint, their_key in ((pub.endpoints["events"], info.curve_public),
                                                (relay.endpoints["events"], server.public.decode())):
                        flood = ctx.socket(zmq.SUB)
                        flood.linger = 0
                        flood.reconnect_ivl = -1  # cut once, it stays away: each cut is one flood
                        load_client_keys(keys, "watcher", their_key).apply(flood)
                        flood.connect(endpoint)
                        for i in range(PER_PEER + 50):
                            flood.subscribe(f"junk-{i:04d}")
                        floods.append(flood)
                    wait_until(lambda: pub.refusals().get("events_subscriptions", 0) >= 1
                               and relay.stats.subscriptions_refused >= 1, 15,
                               "the flood refused at the trainer and at the relay")

                    def served() -> bool:
                        pub.publish("batch_end", (0, 1, 1, 1, 0), {"i": 1})
                        return sub.recv(timeout=0.05) is not None

                    wait_until(served, 10, "batch_end through the relay meanwhile")
                    # one cut each: the trainer never cut the relay for its monitors' flood
                    assert pub._service._subscriptions.cut == 1 and relay._subscriptions.cut == 1
        finally:
            for flood in floods:
                flood.close()
            ctx.term()


def test_without_keys_a_monitor_asking_too_many_subscriptions_is_cut_at_the_relay_and_no_other(
        tmp_path):
    # issue 44: a relay without keys filed every prefix its monitors sent (libzmq's proxy),
    # and passed them all to the trainer, where the relay's one connection would be cut
    # with every monitor behind it; it now files them by connection, keys or not
    from offloop.bus.subscription_cap import PER_PEER

    with a_run(tmp_path) as (pub, _, run_dir), Relay(read_run_info(run_dir)) as relay:
        ctx = zmq.Context()
        flood = ctx.socket(zmq.SUB)
        flood.linger = 0
        flood.reconnect_ivl = -1  # cut once, it stays away
        try:
            with Subscriber(relay.endpoints["events"], topics=["batch_end"], context=ctx) as sub:
                sub.connect()
                flood.connect(relay.endpoints["events"])
                for i in range(PER_PEER + 50):
                    flood.subscribe(f"junk-{i:04d}")
                wait_until(lambda: relay.stats.subscriptions_refused >= 1, 15,
                           "the flood refused at the relay")

                def served() -> bool:
                    pub.publish("batch_end", (0, 1, 1, 1, 0), {"i": 1})
                    return sub.recv(timeout=0.05) is not None

                wait_until(served, 10, "batch_end through the relay meanwhile")
                assert relay._subscriptions.cut == 1
                # the trainer saw no more than the relay's own cap: nothing cut or refused there
                assert pub.interest.in_force <= PER_PEER
                assert pub.refusals().get("events_subscriptions", 0) == 0
        finally:
            flood.close()
            ctx.term()


def test_without_keys_a_flood_of_short_subscriptions_costs_the_relay_process_little(tmp_path):
    # issue 44: 20 000 prefixes of 255 bytes from one SUB socket, sent again each time it
    # reconnects, at `offloop relay` (a process of its own) in front of a run without keys
    prefixes = [b"%06d" % i + b"x" * 249 for i in range(20_000)]
    with a_run(tmp_path) as (pub, _, run_dir), \
            a_relay(run_dir, tmp_path / "announced") as (relay, relayed):
        stop = threading.Event()

        def publish() -> None:  # a batch_end a millisecond, as a training loop's
            step = 0
            while not stop.is_set():
                step += 1
                pub.publish("batch_end", (0, step, step, step, 0), {"i": step})
                time.sleep(0.001)

        publisher = threading.Thread(target=publish, daemon=True)
        ctx = zmq.Context()
        flood = ctx.socket(zmq.SUB)
        flood.sndhwm, flood.linger = 0, 0  # every prefix leaves, each time it connects
        try:
            with Subscriber(relayed.endpoints["events"], topics=["batch_end"], context=ctx) as good:
                good.connect()
                publisher.start()
                wait_until(lambda: good.recv(timeout=0.1) is not None, 10, "batch_end via the relay")
                before = memory(relay.pid)["VmRSS"]
                flood.connect(relayed.endpoints["events"])
                for prefix in prefixes:
                    flood.subscribe(prefix)
                received, deadline = 0, time.monotonic() + 3
                while time.monotonic() < deadline:
                    received += good.recv(timeout=0.05) is not None
                grown = memory(relay.pid)["VmHWM"] - before
                report("relay_many_short_subscriptions", peak_growth_mib=round(grown / 2**20, 1),
                       received=received, gaps=good.stats.gaps)
                assert grown < 64 << 20, f"the relay grew by {grown / 2**20:.0f} MiB"
                assert received > 100 and good.stats.gaps == 0, "the flood cost the monitor its events"
                assert pub.refusals().get("events_subscriptions", 0) == 0, "the trainer cut the relay"
        finally:
            stop.set()
            if publisher.is_alive():
                publisher.join(5)
            flood.close()
            ctx.term()


def test_the_relay_keeps_at_most_max_connections_on_its_request_sockets(tmp_path):
    from helpers.raw_zmtp import hold_partial, is_closed

    from offloop.bus.connection_cap import MAX_CONNECTIONS
    from offloop.bus.wire import request_socket_cap

    with a_run(tmp_path) as (_, _, run_dir), Relay(read_run_info(run_dir)) as relay:
        held = [hold_partial(relay.endpoints["state"], b"DEALER", request_socket_cap())
                for _ in range(MAX_CONNECTIONS + 2)]
        try:
            wait_until(lambda: relay.stats.connections_cut == 2, 15, "two connections cut")
            wait_until(lambda: sum(map(is_closed, held)) == 2, 10, "two closed")
        finally:
            for conn in held:
                conn.close()
