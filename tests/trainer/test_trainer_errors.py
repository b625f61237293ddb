"""Bad input to the Trainer: one clear error naming the problem, before training where knowable."""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers.trainers import loader, mlp
from torch import nn

from offloop.trainer import CheckpointError, ConfigError, Trainer, TrainerError
from offloop.trainer.arguments import resolve_device
from offloop.trainer.batches import batch_size

F = torch.nn.functional


def make(**kw):
    args = {"model": mlp(), "train_dataloader": loader(16, 8), "max_duration": "1ep",
            "loss_fn": F.cross_entropy, "publish": False}
    args.update(kw)
    return Trainer(**args)


@pytest.mark.parametrize("duration", ["3 epochs", "ep", "1.5ep", "-1ba", "10min"])
def test_bad_duration_string_names_the_value_and_what_is_valid(duration, tmp_path):
    with pytest.raises(ConfigError, match=rf"max_duration: bad duration string '{duration}'.*'500ba'"):
        make(max_duration=duration, run_dir=tmp_path)


def test_bad_eval_interval_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="eval_interval"):
        make(eval_dataloader=loader(8, 8), eval_interval="100sp", run_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"names \['nope'\]"):
        make(eval_dataloader=loader(8, 8), eval_interval={"nope": "1ep"}, run_dir=tmp_path)


def test_model_with_no_loss_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="Sequential has no loss.*loss_fn="):
        make(loss_fn=None, run_dir=tmp_path)


def test_batch_of_the_wrong_form_is_named_and_nothing_is_trained(tmp_path):
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [{"x": torch.randn(4, 8), "y": torch.zeros(4, dtype=torch.long)}]
    trainer = make(model=model, train_dataloader=batches, run_dir=tmp_path)
    with pytest.raises(TrainerError, match=r"\(input, target\) pair; got a dict with keys \['x', 'y'\]"):
        trainer.fit()
    # on a GPU machine the Trainer moved the model to the GPU (Composer's default device)
    assert all(torch.equal(before[k], v.cpu()) for k, v in model.state_dict().items())


def test_missing_load_path_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="load_path .*missing.pt' does not exist"):
        make(load_path=tmp_path / "missing.pt", run_dir=tmp_path)


def test_unknown_device_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="device 'tpu' is not a device"):
        make(device="tpu", run_dir=tmp_path)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            make(device="cuda", run_dir=tmp_path)
        with pytest.raises(ConfigError, match="device 'gpu' was asked for, but this machine has no CUDA device"):
            make(device="gpu", run_dir=tmp_path)  # Composer's name for the CUDA device


def test_under_torchrun_each_rank_trains_on_its_own_gpu_and_a_rank_without_one_is_named():
    # resolve_device is told how many GPUs there are, so this runs on any machine; the
    # GPU test launches two ranks on a one-GPU node for real
    assert resolve_device("auto", local_rank=1, cuda_devices=2) == torch.device("cuda", 1)
    assert resolve_device("gpu", local_rank=1, cuda_devices=2) == torch.device("cuda", 1)
    assert resolve_device("cuda", local_rank=0, cuda_devices=2) == torch.device("cuda", 0)
    assert resolve_device("cuda:0", local_rank=1, cuda_devices=2) == torch.device("cuda", 0)  # as asked
    assert resolve_device("cpu", local_rank=1, cuda_devices=2) == torch.device("cpu")
    assert resolve_device("auto", local_rank=1, cuda_devices=0) == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"device 'auto' gives each rank its own GPU, cuda:LOCAL_RANK, but this "
                                          r"rank's LOCAL_RANK is 2 and this machine has 2 CUDA device\(s\): start "
                                          r"at most 2 process\(es\) per node, or pass device='cpu'"):
        resolve_device("auto", local_rank=2, cuda_devices=2)


def test_bad_precision_and_grad_accum(tmp_path):
    with pytest.raises(ConfigError, match="precision 'fp8' is not one of fp32, amp_fp16, amp_bf16"):
        make(precision="fp8", run_dir=tmp_path)
    with pytest.raises(ConfigError, match="grad_accum must be an int >= 1, got 0"):
        make(grad_accum=0, run_dir=tmp_path)


def test_composer_protocol_model_trains_without_loss_fn(tmp_path):
    class Composerish(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, batch):
            return self.net(batch[0])

        def loss(self, outputs, batch):
            return F.cross_entropy(outputs, batch[1])

    trainer = make(model=Composerish(), loss_fn=None, run_dir=tmp_path)
    trainer.fit()
    assert trainer.timestamp.batch == 2


def test_a_missing_load_path_fails_before_any_socket_or_worker(tmp_path):
    from offloop.workers import Callback

    started = time.monotonic()
    with pytest.raises(CheckpointError, match="does not exist"):
        make(load_path=tmp_path / "missing.pt", run_dir=tmp_path / "run", publish=True,
             callbacks=[Callback()])
    assert not (tmp_path / "run").exists()  # no run.json, no worker was spawned
    assert time.monotonic() - started < 10


def test_an_unreadable_checkpoint_ends_the_run_it_had_started(tmp_path):
    from offloop.bus import find_run
    from offloop.workers import Callback

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="not a readable offloop checkpoint"):
        make(load_path=garbage, run_dir=tmp_path / "run", publish=True, callbacks=[Callback()])
    # the bus and a worker had started: both are ended, the run is marked finished, and
    # nothing waits the minute a worker is given to see fit_end
    assert find_run(str(tmp_path / "run")).finished
    assert time.monotonic() - started < 30



@pytest.mark.parametrize("interval", [-0.001, 61, "5ms", True, None])
def test_bad_burst_interval_is_refused(interval, tmp_path):
    with pytest.raises(ConfigError, match=r"burst_interval must be seconds between 0 and 60, got "):
        make(burst_interval=interval, run_dir=tmp_path)


@pytest.mark.parametrize("nice", [-1, 20, 2.5, True, "10"])
def test_bad_worker_nice_is_refused(nice, tmp_path):
    with pytest.raises(ConfigError, match=r"worker_nice must be an int between 0 and 19, got "):
        make(worker_nice=nice, run_dir=tmp_path)


def test_fit_eval_and_predict_on_a_closed_trainer_are_refused_by_name(tmp_path):
    trainer = Trainer(mlp(), loader(16, 8), "1ba", loss_fn=torch.nn.functional.cross_entropy,
                      run_dir=tmp_path / "run")
    trainer.fit()
    trainer.close()
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    for name, call in (("fit", lambda: trainer.fit(duration="2ba")),
                       ("eval", lambda: trainer.eval(loader(16, 8))),
                       ("predict", lambda: trainer.predict([torch.randn(4, 8)]))):
        with pytest.raises(TrainerError, match=rf"^{name}\(\) on a closed Trainer: close\(\) ended"):
            call()
    assert trainer.timestamp.batch == 1  # nothing more trained
    assert all(torch.equal(a, b) for a, b in zip(weights, trainer.model.parameters(), strict=True))


def test_a_halt_reason_that_is_not_a_str_is_refused_in_process(tmp_path):
    with Trainer(mlp(), loader(), "1ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "run") as trainer:
        with pytest.raises(TrainerError, match="request_halt\\(reason\\) takes a str, got bytes"):
            trainer.request_halt(b"enough")
        trainer.fit()  # nothing was halted
        assert trainer.stopped_by is None and trainer.timestamp.epoch == 1
    assert json.loads((tmp_path / "run" / "run.json").read_text())["finished"] is True


def test_a_closed_trainer_is_freed_once_nothing_else_holds_it(tmp_path):
    import gc
    import weakref

    trainer = Trainer(mlp(), loader(), "1ep", loss_fn=F.cross_entropy, run_dir=tmp_path / "run")
    trainer.fit()
    trainer.close()
    ref = weakref.ref(trainer)
    del trainer
    gc.collect()
    assert ref() is None  # atexit no longer holds it


@pytest.mark.parametrize("batch, size", [
    ((torch.zeros(7, 3), torch.zeros(7)), 7),  # the usual (input, target)
    ([torch.zeros(5, 2), torch.zeros(5)], 5),
    ({"input_ids": torch.zeros(4, 9, dtype=torch.long)}, 4),
    (((torch.zeros(3, 2), torch.zeros(3, 2)), torch.zeros(3)), 3),  # a nested input
    (torch.zeros(6, 2), 6),
    ((torch.tensor(2.0), torch.zeros(1)), 1),  # a 0-d first tensor counts as one sample
    ((torch.nn.Parameter(torch.zeros(2, 2)), torch.zeros(2)), 2),  # a Tensor subclass
])
def test_a_batchs_size_is_its_first_tensors_first_dimension(batch, size):
    assert batch_size(batch) == size


@pytest.mark.parametrize("batch", [(), ["text"], {}, 3.0])
def test_a_batch_without_a_tensor_has_its_size_refused_by_its_type(batch):
    with pytest.raises(TrainerError, match="cannot tell the batch size of a"):
        batch_size(batch)
