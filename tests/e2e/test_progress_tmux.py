"""Console progress as Composer prints it, drawn by the shared worker in a real terminal
(tmux), and nothing drawn where stderr is not a terminal."""

from __future__ import annotations

import shlex
import sys

import torch
import torch.nn.functional as F
from test_attach_tmux import tmux  # noqa: F401 (the fixture)
from torch.utils.data import DataLoader, TensorDataset

from offloop import Trainer
from offloop.callbacks import LRMonitor
from offloop.workers.callbacks.progress import render

SCRIPT = """
import time
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from offloop import Callback, Trainer
class SlowEpochEnd(Callback):  # in the worker that draws the bars, before it draws them
    def epoch_end(self, state, logger):
        time.sleep(1.0)
x = torch.randn(32, 8)
data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
model = torch.nn.Linear(8, 2)
Trainer(model, data, '2ep', loss_fn=F.cross_entropy, eval_dataloader=data, run_dir={run_dir!r},
        callbacks=[SlowEpochEnd()]).fit()
print('TRAINED')
"""


def test_a_trainer_in_a_terminal_shows_composers_progress_bars(tmp_path, tmux):  # noqa: F811
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(run_dir=str(tmp_path / "run")))
    tmux.start(f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}; sleep 30", width=140)
    tmux.wait_for("TRAINED", timeout=90)
    screen = tmux.screen()  # as it is when fit() has returned: the bars are whole, above the output
    for epoch in (0, 1):
        assert f"train Epoch   {epoch}: 100%|{'█' * 25}| 4/4 [" in screen, screen
    assert "loss/train/total=" in screen and "eval  Batch    4: 100%" in screen, screen
    assert "loss=" in screen  # the eval bar ends with the evaluation's metrics (here its loss)
    assert screen.index("TRAINED") > screen.index("train Epoch   1: 100%"), screen


def _data() -> DataLoader:
    x = torch.randn(32, 8)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


def test_no_terminal_no_progress_worker_and_log_to_console_prints_lines(tmp_path, capfd):
    with Trainer(torch.nn.Linear(8, 2), _data(), "1ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "a") as quiet:
        quiet.fit()
        assert quiet.workers.workers == []  # pytest's stderr is no terminal: no bar, no worker for it
    with Trainer(torch.nn.Linear(8, 2), _data(), "1ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "b",
                 log_to_console=True) as chatty:
        chatty.fit()
    err = capfd.readouterr().err
    assert "[step 4] loss/train/total: " in err and "|" not in err


def test_a_run_with_no_logger_and_no_progress_bar_prints_nothing_per_step(tmp_path, capfd):
    # as Composer's: LRMonitor logs every step, and with no destination nothing is printed
    with Trainer(torch.nn.Linear(8, 2), _data(), "10ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "run",
                 callbacks=[LRMonitor()], progress_bar=False) as trainer:
        trainer.fit()
        assert len(trainer.workers.workers) == 1  # the callback ran, in its worker
    out, err = capfd.readouterr()
    assert "lr-" not in out + err and "[step" not in out + err, (out + err)[-2000:]
    assert len((out + err).splitlines()) < 5, (out + err)[-2000:]  # not a line per step (40 steps)


def test_a_bar_renders_as_tqdm_draws_it():
    bar = {"title": "train Epoch   0", "total": 8, "n": 4, "started": 0.0, "postfix": "loss/train/total=0.5000"}
    assert render(bar, 2.0) == ("train Epoch   0:  50%|████████████▌            | 4/8 "
                                "[00:02<00:02, 2.00ba/s, loss/train/total=0.5000]")
    assert render({**bar, "total": None}, 2.0) == "train Epoch   0: 4ba [00:02, 2.00ba/s, loss/train/total=0.5000]"
