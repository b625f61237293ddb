"""A run whose callbacks, each in a process of its own, print a lot, some lines in pieces.

argv: workers, batches, lines per batch_end. Prints nothing itself but a last line "done".
Each callback line is "<tag> <batch> <i> " followed by 280 x's and the tag again.
"""

import sys

import torch

from offloop import Callback, Trainer


class Chatty(Callback):
    def __init__(self, tag: str, lines: int) -> None:
        self.tag, self.lines = tag, lines

    def batch_end(self, state, logger) -> None:
        for i in range(self.lines):
            head = f"{self.tag} {state.timestamp.batch} {i} "
            if i % 3 == 0:  # a line printed in pieces
                print(head, end="")
                print("x" * 280, end="")
                print(f" {self.tag}")
            else:
                print(head + "x" * 280 + f" {self.tag}")


workers, batches, lines = map(int, sys.argv[1:4])
data = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(batches)]
trainer = Trainer(torch.nn.Linear(8, 2), data, "1ep", loss_fn=torch.nn.functional.cross_entropy,
                  callbacks=[Chatty(f"w{k}", lines).in_own_process() for k in range(workers)],
                  run_dir=sys.argv[4], worker_shutdown_timeout=120)
trainer.fit()
trainer.close()
print("done", flush=True)
