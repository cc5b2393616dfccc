"""The kernel registry: selection by what a backend declares, fallback to the reference,
clear errors for unknown names, one table per model, the dispatch logged once."""

from __future__ import annotations

import logging

import pytest
import torch

from kohakumoss.errors import KohakuError, user_message
from kohakumoss.kernels import KernelError, KernelRegistry
from kohakumoss.model import FLAVORS, MOSSImageTransformer, build_layout
from kohakumoss.model import ops
from kohakumoss.model.build import tiny_transformer

CPU = torch.device("cpu")


def _cpu_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


def _never(device: torch.device, dtype: torch.dtype) -> bool:
    return False


class Counting:
    """A test backend: the reference, counting its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0
        self.__qualname__ = f"counting({fn.__qualname__})"

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


@pytest.fixture
def registry():
    r = KernelRegistry()
    r.register("rms_norm", "test", Counting(ops.rms_norm), _cpu_fp32)
    r.register("rms_norm", "gpu_only", Counting(ops.rms_norm), _never)
    return r


def test_a_backend_that_can_run_is_selected_and_used(registry):
    table = registry.build_op_table(CPU, torch.float32, {"rms_norm": "test"})
    backend = registry.backend("rms_norm", "test").fn
    assert [b.fn for b in table.rms_norm.fn.backends] == [backend]
    assert all(getattr(table, n).fn is f for n, f in ops.REFERENCE.items() if n != "rms_norm")
    model = tiny_transformer()
    model.ops = table
    reference = tiny_transformer()
    layout = build_layout([(2, 3)], [4])
    c = FLAVORS["tiny"]
    args = (torch.randn(layout.n_img, c.latent_channels), torch.randn(layout.n_txt, c.text_dim),
            torch.rand(1))
    with torch.no_grad():
        assert torch.equal(model(*args, layout), reference(*args, layout))
    assert backend.calls == 2 * c.text_blocks  # the text blocks' two norms


def test_a_backend_that_cannot_run_falls_back_to_the_reference(registry, caplog):
    with caplog.at_level(logging.INFO, "kohakumoss.kernels"):
        table = registry.build_op_table(CPU, torch.bfloat16, {"rms_norm": "test"})
    assert table.rms_norm.fn is ops.rms_norm
    assert "rms_norm: test cannot run here" in caplog.text and "every op reference" in caplog.text
    # an ordered choice: the first that can run wins
    chosen, unable = registry.dispatch(CPU, torch.float32, {"rms_norm": ["gpu_only", "test"]})
    assert chosen["rms_norm"] == "test" and unable == {"rms_norm": ["gpu_only"]}
    chosen, _ = registry.dispatch(CPU, torch.float32, {"rms_norm": ["reference", "test"]})
    assert chosen["rms_norm"] == "reference"


def test_a_static_choice_respects_fits_per_call_and_a_failing_backend_is_an_error():
    """A chosen backend runs only the shapes its ``fits`` takes (the reference the rest), and
    one that raises at run time stops the run with an error naming the op, the backend and
    the knob that leaves it out (never a silent fall-back)."""
    from kohakumoss.kernels.dispatch import BackendFailed

    r = KernelRegistry()
    narrow = Counting(ops.rms_norm)
    r.register("rms_norm", "narrow", narrow, _cpu_fp32, fits=lambda d: d["D"] <= 8)

    def broken(*args):
        raise RuntimeError("no kernel image for this device")

    r.register("rms_norm", "broken", broken, _cpu_fp32)
    op = r.build_op_table(CPU, torch.float32, {"rms_norm": ["narrow"]}).rms_norm
    x8, x16 = torch.randn(5, 8), torch.randn(5, 16)
    assert torch.equal(op(x8, torch.ones(8), 1e-6), ops.rms_norm(x8, torch.ones(8), 1e-6))
    assert torch.equal(op(x16, torch.ones(16), 1e-6), ops.rms_norm(x16, torch.ones(16), 1e-6))
    assert narrow.calls == 1 and op.backend_for(x16, torch.ones(16), 1e-6) == "reference"
    op = r.build_op_table(CPU, torch.float32, {"rms_norm": ["broken", "narrow"]}).rms_norm
    with pytest.raises(BackendFailed) as e:
        op(x8, torch.ones(8), 1e-6)
    assert str(e.value) == (
        "rms_norm: backend broken failed at run time (RuntimeError: no kernel image for this "
        "device); leave it out with kernels.backends (the backends to use, without broken), or "
        "set kernels.table: off to run every op's reference")
    assert narrow.calls == 1 and isinstance(e.value, KernelError)


def test_a_backends_stream_form_runs_and_a_failing_one_is_an_error():
    """``ops.stream_norm`` takes a chosen backend's ``stream`` form (the half's norm and x
    through one node); one that raises is an error naming the form and the backend."""
    from kohakumoss.kernels.dispatch import BackendFailed

    r = KernelRegistry()
    streamed, plain = [], Counting(ops.modulated_rms_norm)

    def stream(x, *rest):
        streamed.append(1)
        return ops.modulated_rms_norm(x, *rest), x

    def failing(*args):
        raise RuntimeError("no kernel image for this device")

    good = Counting(ops.modulated_rms_norm)
    bad = Counting(ops.modulated_rms_norm)
    r.register("modulated_rms_norm", "good", good, _cpu_fp32, forms={"stream": stream})
    r.register("modulated_rms_norm", "bad", bad, _cpu_fp32, forms={"stream": failing})
    r.register("modulated_rms_norm", "plain", plain, _cpu_fp32)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 8, generator=g), torch.randn(8, generator=g)
    shift, scale, seg = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g), torch.tensor([0, 0, 0, 1, 1, 1])
    want = ops.modulated_rms_norm(x, w, shift, scale, seg, 1e-6)
    op = r.build_op_table(CPU, torch.float32, {"modulated_rms_norm": ["good"]}).modulated_rms_norm
    y, x_res = ops.stream_norm(op, x, w, shift, scale, seg, 1e-6)
    assert streamed == [1] and good.calls == 0 and torch.equal(y, want) and x_res is x
    op = r.build_op_table(CPU, torch.float32, {"modulated_rms_norm": ["bad", "plain"]}).modulated_rms_norm
    with pytest.raises(BackendFailed, match="modulated_rms_norm: the stream form of backend bad "
                                            r"failed at run time \(RuntimeError: no kernel image"):
        ops.stream_norm(op, x, w, shift, scale, seg, 1e-6)
    assert plain.calls == 0 and bad.calls == 0
    y, x_res = ops.stream_norm(ops.modulated_rms_norm, x, w, shift, scale, seg, 1e-6)  # no form
    assert torch.equal(y, want) and x_res is x


@pytest.mark.parametrize("mode", ["block", "selective", "sub-block"])
def test_checkpointings_early_stop_passes_through_a_chosen_backend(mode):
    """Non-reentrant checkpointing stops a recomputation by raising from inside the op that
    saves the last tensor it needs: a chosen backend's dispatch lets it through (taken for a
    failure, the backend was dropped and the op ran twice, which checkpointing refuses), and
    the gradients are the uncheckpointed ones."""
    from kohakumoss.memory import apply_checkpointing

    r = KernelRegistry()
    for name in ops.REFERENCE:
        r.register(name, "py", Counting(ops.REFERENCE[name]), _cpu_fp32)
    layout = build_layout([(2, 3), (3, 2)], [4, 3])
    c = FLAVORS["tiny"]
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(layout.n_img, c.latent_channels, generator=g),
            torch.randn(layout.n_txt, c.text_dim, generator=g), torch.rand(2, generator=g))
    grads = []
    for checkpointing in ("none", mode):
        model = tiny_transformer()
        model.ops = r.build_op_table(CPU, torch.float32, {name: ["py"] for name in ops.REFERENCE})
        if checkpointing != "none":
            apply_checkpointing(model, checkpointing)
        model(*args, layout).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_unknown_names_are_clear_errors(registry):
    with pytest.raises(KernelError, match="unknown op 'rms_nrom'; the op tables have rms_norm, "):
        registry.build_op_table(CPU, torch.float32, {"rms_nrom": "test"})
    # a typo is an error even where the backend could not have run anyway
    with pytest.raises(KernelError, match="op 'rms_norm' has no backend 'tset'; it has "
                                          "reference, test, gpu_only"):
        registry.build_op_table(CPU, torch.bfloat16, {"rms_norm": ["tset"]})
    with pytest.raises(KernelError, match="already has a backend named 'test'"):
        registry.register("rms_norm", "test", ops.rms_norm, _cpu_fp32)
    with pytest.raises(KernelError, match="already has a backend named 'reference'"):
        registry.register("situ", "reference", ops.situ, _cpu_fp32)
    with pytest.raises(KernelError, match="unknown op 'fused_everything'"):
        registry.register("fused_everything", "x", ops.situ, _cpu_fp32)
    with pytest.raises(KohakuError) as e:  # a user error: one line, no traceback
        registry.backend("situ", "triton")
    assert user_message(e.value) == "op 'situ' has no backend 'triton'; it has reference"
    registry.unregister("rms_norm", "gpu_only")
    assert registry.names("rms_norm") == ["reference", "test"]


def test_two_models_tables_are_independent(registry):
    a, b = MOSSImageTransformer(FLAVORS["tiny"]), MOSSImageTransformer(FLAVORS["tiny"])
    a.ops = registry.build_op_table(CPU, torch.float32, {"rms_norm": "test"})
    b.ops = registry.build_op_table(CPU, torch.float32, {"rms_norm": "test"})
    assert a.ops is not b.ops
    a.ops.override("situ", Counting(ops.situ))
    assert b.ops.situ.fn is ops.situ
    assert MOSSImageTransformer(FLAVORS["tiny"]).ops.rms_norm.fn is ops.rms_norm


def test_the_dispatch_is_logged_once(registry, caplog):
    with caplog.at_level(logging.INFO, "kohakumoss.kernels"):
        for _ in range(3):
            registry.build_op_table(CPU, torch.float32, {"rms_norm": "test"})
        registry.build_op_table("cpu", torch.float32, {"rms_norm": ["test"]})  # the same dispatch
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["kernels on cpu/float32: rms_norm=test, the rest reference"]
    with caplog.at_level(logging.INFO, "kohakumoss.kernels"):
        registry.build_op_table(CPU, torch.float32)  # another dispatch: logged, once
        registry.build_op_table(CPU, torch.float32, {})
    assert [r.getMessage() for r in caplog.records][1:] == ["kernels on cpu/float32: every op reference"]


def test_the_loss_is_the_objectives_op_not_the_dits():
    """The model's table holds the DiT's math only; the loss is the objective's op
    (``diffusion.objective.OBJECTIVE``), a table of its own built by the same registry: a
    backend chosen for it runs there, and the DiT's table never sees the choice."""
    from kohakumoss.diffusion.objective import OBJECTIVE, flow_loss, reference_flow_loss

    assert "flow_loss" not in ops.REFERENCE and set(OBJECTIVE) == {"flow_loss"}
    with pytest.raises(AttributeError, match="op 'flow_loss' is not in the op table"):
        MOSSImageTransformer(FLAVORS["tiny"]).ops.flow_loss
    r = KernelRegistry()
    fused = Counting(reference_flow_loss)
    r.register("flow_loss", "fused", fused, _cpu_fp32)
    choice = {"flow_loss": ["fused"], "situ": ["reference"]}
    model_table = r.build_op_table(CPU, torch.float32, choice)
    objective = r.build_op_table(CPU, torch.float32, choice, contract=OBJECTIVE)
    assert model_table.names().keys() == ops.REFERENCE.keys()
    assert objective.names() == {"flow_loss": "chosen(flow_loss: fused, reference)"}
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(7, 4, generator=g), torch.randn(7, 4, generator=g)
    seg, weight = torch.tensor([0, 0, 0, 1, 1, 1, 1]), torch.tensor([1.0, 0.5])
    got = flow_loss(pred, target, seg, weight, 7, ops=objective)
    assert fused.calls == 1 and torch.equal(got, reference_flow_loss(pred, target, seg, weight, 7))
