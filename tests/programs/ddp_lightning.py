"""Two CPU processes of Lightning DDP (gloo) with offloop: a checkpoint requested at
batch 2 and a halt at batch 4 over the control channel. Lightning starts rank 1 by
running this script again; each rank writes what it saw to OUT/rank-N.json.

Run: python tests/programs/ddp_lightning.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, for helpers (rank 1 runs this again)

from helpers.lightning_module import AskAt, Classifier, loader, trainer  # noqa: E402

from offloop.integrations.lightning import OffloopCallback  # noqa: E402

out = Path(sys.argv[1])
offloop = OffloopCallback(run_dir=out / "run")
checkpoint = AskAt(offloop, 2, "checkpoint", {"tag": "ddp"})
halt = AskAt(offloop, 4, "halt", {"reason": "both ranks"})
pl_trainer = trainer([checkpoint, halt, offloop], strategy="ddp", devices=2, max_epochs=5)
pl_trainer.fit(Classifier(), loader(64))
acks = {}
for name, asker in (("checkpoint", checkpoint), ("halt", halt)):
    if asker.request.thread is not None:  # rank 0 sent it
        ack = asker.ack()
        acks[name] = {"ok": ack.ok, "result": ack.result, "error": ack.error}
rank = pl_trainer.global_rank
(out / f"rank-{rank}.json").write_text(json.dumps({
    "rank": rank, "global_step": pl_trainer.global_step, "acks": acks, "pid": os.getpid(),
    "world_size": pl_trainer.world_size, "batch": offloop.run.timestamp.batch}))
