"""A local peer attacking a run without keys (issue 24's measurement): into the events
socket one frame that is no subscription (naming the burst topic) and four 64 MiB
messages; into the control socket 40 requests of about 4 MiB each, none of them valid.
argv = events endpoint, control endpoint. Prints what the control socket answered.

It runs in a process of its own: libzmq cuts it off for the oversized messages, and with
pyzmq 27 the cut-off sender itself may crash."""

import json
import sys

import zmq

from offloop.bus.wire import decode_reply, encode_request

events, control = sys.argv[1], sys.argv[2]
ctx = zmq.Context()
dealer = ctx.socket(zmq.DEALER)
dealer.linger = 0
dealer.connect(control)
pad = "x" * ((4 << 20) - 4096)
for req in range(40):  # half with a reason that is not a str, half with an op there is not
    args = {"reason": pad.encode()} if req % 2 else {"pad": pad}
    dealer.send(encode_request("ctl", client="attacker", req=req, op="halt" if req % 2 else "nope",
                               args=args, t=0.0))
answers = {"refused": 0, "applied": 0}
for _ in range(40):
    if not dealer.poll(10_000):
        break
    reply = decode_reply(dealer.recv())  # an error reply (malformed) or an ack
    answers["applied" if reply["k"] == "ack" and reply["ok"] else "refused"] += 1
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
