"""The contiguous gradient buffer: what the optimizer sees is exactly what
zero_grad(set_to_none=True) gives it (weights bit for bit), the published norm is the
step's, and the buffer is not adopted (or is given up) wherever it would change that."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from offloop.trainer import Trainer
from offloop.trainer.errors import ConfigError
from offloop.trainer.grads import GradBuffer

F = torch.nn.functional
STEPS = 12


class SometimesUnused(nn.Module):
    """Its `extra` layer takes part in odd-numbered forward passes only: on even steps
    it has no gradient, and an optimizer with momentum and weight decay must skip it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.extra, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = torch.relu(self.body(x))
        if self.calls % 2:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in range(n)]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def hand_written(data, make_opt=sgd) -> tuple[nn.Module, list[float]]:
    """The reference: zero_grad(set_to_none=True), forward, loss, backward, step."""
    model = SometimesUnused()
    opt, norms = make_opt(model), []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
        opt.step()
    return model, norms


def train(tmp_path, data, make_opt=sgd, model=None, **kwargs) -> tuple[Trainer, list]:
    """On the CPU, GPU or not: the buffer is adopted for CPU parameters only."""
    model = model or SometimesUnused()
    trainer = Trainer(model, data, f"{len(data)}ba", loss_fn=F.cross_entropy, optimizers=make_opt(model),
                      publish=False, run_dir=tmp_path / "run", seed=1, device="cpu", **kwargs)
    seen = []  # (grad_norm the trainer published, which parameters had a gradient)
    original = trainer.emitter.snapshot

    def probe(topic, ts, data):
        if topic == "grad_norms":
            seen.append((data["grad_norm"], [p.grad is not None for p in model.parameters()]))
        return original(topic, ts, data)

    trainer.emitter.snapshot = probe
    trainer.emitter.wants = lambda topic: topic == "grad_norms"
    trainer.fit()
    trainer.close()
    return trainer, seen


@pytest.mark.parametrize("make_opt", [sgd, lambda m: torch.optim.Adam(m.parameters(), lr=0.01)],
                         ids=["sgd-momentum-wd", "adam"])
def test_the_buffer_trains_bit_for_bit_as_set_to_none_and_unused_parameters_are_skipped(tmp_path, make_opt):
    data = batches()
    reference, ref_norms = hand_written(data, make_opt)
    trainer, seen = train(tmp_path, data, make_opt)
    assert trainer.grad_buffer is not None, "the buffer was not adopted"
    for ours, theirs in zip(trainer.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    # the extra layer (parameters 2 and 3) had no gradient on even steps, as set_to_none gives
    assert [has[2] and has[3] for _, has in seen] == [i % 2 == 0 for i in range(STEPS)]
    for (norm, _), expected in zip(seen, ref_norms, strict=True):
        assert math.isclose(norm, expected, rel_tol=1e-6)


@pytest.mark.parametrize("replaced", ["head", "body"])
def test_a_grad_replaced_during_a_step_gives_the_buffer_up_and_training_goes_on_unchanged(tmp_path,
                                                                                           replaced):
    """In a step where `extra` gets no gradient (the sixth): replaced after it (`head`) or
    before it (`body`), `extra` still goes to None, as zero_grad(set_to_none=True) leaves it."""
    class Replacer(SometimesUnused):
        def forward(self, x):
            if self.calls == 5:
                getattr(self, replaced).weight.grad = None  # backward now makes a tensor of its own
            return super().forward(x)

    data = batches()
    reference, ref_norms = hand_written(data)
    model = Replacer()
    trainer, seen = train(tmp_path, data, model=model)
    assert trainer.grad_buffer is None and not trainer.grad_buffer_pending  # given up, not adopted again
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    for (norm, _), expected in zip(seen, ref_norms, strict=True):
        assert math.isclose(norm, expected, rel_tol=1e-6)


class MarksItsAccumulator(nn.Module):
    """At each forward, marks its weight's gradient accumulator (the autograd node that adds
    into `.grad`) and records the mark the node already had: None for a node built anew."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.seen = nn.Linear(8, 3), []

    def forward(self, x):
        node = get_gradient_edge(self.lin.weight).node  # the live one, or a new one
        self.seen.append(node.metadata.get("forward"))
        node.metadata.setdefault("forward", len(self.seen))
        return self.lin(x)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_each_forward_reuses_the_accumulators_the_first_one_built_and_fit_keeps_none(tmp_path, grad_accum):
    """As a hand-written loop's `loss` keeps its graph until the next step: building the
    nodes anew at every step costs instructions a step (docs/trainer.md)."""
    model = MarksItsAccumulator()
    train(tmp_path, batches(4), model=model, grad_accum=grad_accum)
    assert model.seen == [None] + [1] * (4 * grad_accum - 1)
    model(torch.randn(2, 8))  # after fit() no graph of it is kept: the node is new
    assert model.seen[-1] is None


def test_contiguous_grads_false_keeps_set_to_none_and_a_bad_value_is_refused(tmp_path):
    data = batches(4)
    trainer, _ = train(tmp_path, data, contiguous_grads=False)
    assert trainer.grad_buffer is None
    with pytest.raises(ConfigError, match="contiguous_grads must be True, False or 'auto', got 'yes'"):
        Trainer(SometimesUnused(), data, "1ba", loss_fn=F.cross_entropy, publish=False,
                run_dir=tmp_path / "bad", contiguous_grads="yes")


class Wide(nn.Module):
    """Two tensors of 40 000 elements each: far past what "auto" adopts the buffer for."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(8, 5000, bias=False), nn.Linear(5000, 3, bias=False)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


@pytest.mark.parametrize(("model", "setting", "adopted"), [
    (SometimesUnused, "auto", True), (Wide, "auto", False), (Wide, True, True), (SometimesUnused, False, False),
])
def test_auto_adopts_the_buffer_only_for_small_tensors(tmp_path, model, setting, adopted):
    assert GradBuffer.pays_off(list(model().parameters())) is (model is SometimesUnused)
    trainer, seen = train(tmp_path, batches(4), model=model(), contiguous_grads=setting)
    assert (trainer.grad_buffer is not None) is adopted
    assert len(seen) == 4 and all(norm > 0 for norm, _ in seen)  # norms either way


class OwnZeroGrad(torch.optim.SGD):
    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)


def _after_backward(model: nn.Module, x: torch.Tensor) -> nn.Module:
    model(x).float().sum().backward()
    return model


@pytest.mark.parametrize("case", ["sparse-embedding", "sparse-embedding-unused", "mixed-dtypes", "not-all-optimized",
                                  "own-zero-grad", "frozen-only"])
def test_the_buffer_is_not_adopted_where_it_would_change_what_the_optimizer_sees(case):
    torch.manual_seed(0)
    if case.startswith("sparse-embedding"):
        model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
        if case == "sparse-embedding":
            _after_backward(model, torch.tensor([1, 2, 3]))
        else:  # no gradient in the first step: only the module says its gradients are sparse
            _after_backward(model[1], torch.randn(3, 4))
    else:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        if case == "mixed-dtypes":
            model[1].double()
            model[0].register_forward_hook(lambda m, i, out: out.double())
        if case == "frozen-only":
            model.requires_grad_(False)
        else:
            _after_backward(model, torch.randn(3, 4))
    params = list(model.parameters())
    optimized = params[:2] if case == "not-all-optimized" else params
    opt = (OwnZeroGrad if case == "own-zero-grad" else torch.optim.SGD)(optimized, lr=0.1)
    grads = [p.grad for p in params]
    assert GradBuffer.adopt(model, params, [opt]) is None
    assert all(p.grad is g for p, g in zip(params, grads, strict=True))  # left as they were


def test_adopt_takes_the_first_steps_gradients_and_zero_puts_every_grad_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model(torch.randn(3, 4))[:, :1].sum().backward()
    model[1].bias.grad = None  # as if it had taken no part
    params = list(model.parameters())
    before = [None if p.grad is None else p.grad.clone() for p in params]
    buffer = GradBuffer.adopt(model, params, [torch.optim.SGD(params, lr=0.1)])
    assert buffer is not None
    for p, g, old in zip(params, buffer.grads, before, strict=True):
        assert (p.grad is None) if old is None else (p.grad is g and torch.equal(g, old))
    expected = torch.linalg.vector_norm(torch.cat([b.reshape(-1) for b in before if b is not None])).item()
    assert math.isclose(buffer.norm(), expected, rel_tol=1e-6)
    buffer.zero()
    assert all(p.grad is g for p, g in zip(params, buffer.grads, strict=True))
    assert buffer.norm() == 0.0 and buffer.flat.untyped_storage().data_ptr() == \
        params[0].grad.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_buffers_norm_is_the_gradients_l2_norm_in_every_float_dtype(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 10)).to(dtype)
    model(torch.randn(32, 64, dtype=dtype)).float().square().mean().backward()
    params = list(model.parameters())
    expected = torch.linalg.vector_norm(torch.cat([p.grad.double().reshape(-1) for p in params])).item()
    buffer = GradBuffer.adopt(model, params, [torch.optim.SGD(params, lr=0.1)])
    assert buffer is not None
    # a dot product for float32/64 (summed in the dtype), vector_norm for half types (summed in float32)
    assert math.isclose(buffer.norm(), expected, rel_tol={torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 1e-2))
    if dtype in (torch.float32, torch.float64):  # the dot: a square that overflows gives inf, as vector_norm's
        buffer.flat[0] = torch.finfo(dtype).max
        assert buffer.norm() == math.inf == torch.linalg.vector_norm(buffer.flat).item()


@pytest.mark.parametrize("named", [False, True], ids=["everything", "grad_norms-by-name"])
def test_norms_are_computed_only_for_a_subscriber_that_names_them(tmp_path, monkeypatch, named):
    """A subscriber of every event does not make each step pay for a pass over the
    gradients; one that names `grad_norms` (as GradMonitor does) gets the step's norm."""
    from offloop.bus import GRAD_NORMS, RUN_TOPICS, Subscriber

    data = batches(6)
    model = SometimesUnused()
    trainer = Trainer(model, data, f"{len(data)}ba", loss_fn=F.cross_entropy, optimizers=sgd(model),
                      run_dir=tmp_path / "run", seed=1, burst_interval=0)
    endpoints = trainer.publisher.endpoints
    sub = Subscriber(endpoints["events"], endpoints["state"],
                     topics=[*RUN_TOPICS, GRAD_NORMS] if named else None)
    sub.connect()
    computed = []  # every norm taken (the one place either path, buffer or per parameter, starts)
    norms = trainer.readings.grad_norms
    monkeypatch.setattr(trainer.readings, "grad_norms", lambda buffer: computed.append(1) or norms(buffer))
    trainer.fit()
    topics = []
    while (msg := sub.recv(timeout=2)) is not None and msg.topic != "fit_end":
        topics.append(msg.topic)
    sub.close()
    trainer.close()
    assert topics.count("after_train_batch") == len(data)
    assert topics.count(GRAD_NORMS) == (len(data) if named else 0)
    assert len(computed) == (len(data) if named else 0)
