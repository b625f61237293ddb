"""How a rank names its endpoints in run.json for the other nodes (trainer/distributed.py)."""

import socket

from offloop.trainer.distributed import reachable


def test_a_wildcard_endpoint_is_named_by_the_address_that_reaches_the_rendezvous_host():
    assert reachable("tcp://0.0.0.0:5555", master="127.0.0.1") == "tcp://127.0.0.1:5555"
    assert reachable("tcp://*:7", master="127.0.0.1") == "tcp://127.0.0.1:7"


def test_an_endpoint_bound_to_an_address_keeps_it():
    assert reachable("tcp://10.1.2.3:5555", master="127.0.0.1") == "tcp://10.1.2.3:5555"


def test_without_a_route_to_the_rendezvous_host_the_hostname_names_it():
    # a name that does not resolve: no route can be looked up, so the host names itself
    name = reachable("tcp://0.0.0.0:9", master="not a host name")
    assert name == f"tcp://{socket.gethostname()}:9"
