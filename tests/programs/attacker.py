"""A local peer attacking a run without keys (issue 24's measurement, issue 44's limits):
into the events socket one frame that is no subscription (naming the burst topic) and four
64 MiB messages; into the control socket 40 requests just under its transport cap (each
refused by its length: a request is at most 16 KiB), then four of 4 MiB (each past the cap:
libzmq cuts the connection before buffering it whole). argv = events endpoint, control
endpoint. Prints what the control socket answered, and how many connections it cut.

It runs in a process of its own: libzmq cuts it off for the oversized messages, and with
pyzmq 27 the cut-off sender itself may crash."""

import json
import sys

import zmq

from offloop.bus.wire import decode_reply, encode_request, request_socket_cap

events, control = sys.argv[1], sys.argv[2]
ctx = zmq.Context()
dealer = ctx.socket(zmq.DEALER)
dealer.linger = 0
dealer.connect(control)
pad = "x" * (request_socket_cap() - 4096)
for req in range(40):  # half with a reason that is not a str, half with an op there is not
    args = {"reason": pad.encode()} if req % 2 else {"pad": pad}
    dealer.send(encode_request("ctl", client="attacker", req=req, op="halt" if req % 2 else "nope",
                               args=args, t=0.0))
answers = {"refused": 0, "applied": 0, "cut": 0}
for _ in range(40):
    if not dealer.poll(10_000):
        break
    reply = decode_reply(dealer.recv())  # an error reply (malformed) or an ack
    answers["applied" if reply["k"] == "ack" and reply["ok"] else "refused"] += 1
cuts = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
huge = encode_request("ctl", client="attacker", req=99, op="halt", args={"reason": "x" * (4 << 20)},
                      t=0.0)
for _ in range(4):
    dealer.send(huge)
    if cuts.poll(10_000):
        cuts.recv_multipart()
        answers["cut"] += 1
print(json.dumps(answers), flush=True)

peer = ctx.socket(zmq.XSUB)
peer.linger = 0
peer.sndhwm = 0
peer.connect(events)
peer.send(b"X_burst\0")
big = b"\0" * (64 << 20)
for _ in range(4):
    peer.send(big, copy=False)
peer.close(linger=2000)
print(json.dumps({"sent": True}), flush=True)
