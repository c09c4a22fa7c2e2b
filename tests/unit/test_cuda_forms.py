"""How CudaDevice picks the forms of its one-operation collectives (`_cuda_forms`), and what a
CUDA graph records, from every rank's handle (no GPU needed): the kernel form is what graphs
record, also where ranks that share a GPU run the stream-memory-operation form outside graphs
(GPURING_CUDA_FUSED=auto); GPURING_CUDA_FUSED=memops and off record nothing. The two forms'
state lies apart in a rank's region, so one job runs both."""

from __future__ import annotations

import warnings

import pytest

from gpuring._ops import ReduceOp
from gpuring.devices import _cuda_forms, _cuda_fused, _kernels
from gpuring.devices._cuda_forms import Slots, choose
from gpuring.devices._cuda_memory import CudaHandle

KINDS = frozenset(_kernels.DIRECT_KINDS)
MOST = 4 << 20


def _handles(gpus: list[str], memops: bool = True) -> list[CudaHandle]:
    return [CudaHandle(f"p{r}", "node", gpu, 24, memops, 0, 0, 0, b"") for r, gpu in
            enumerate(gpus)]


@pytest.fixture(autouse=True)
def _no_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cuda_forms, "ring_order", lambda buses: ())


@pytest.mark.parametrize(("mode", "kernel", "staged"), [
    ("auto", 1 << 20, 64 << 10), ("kernel", 1 << 20, 0), ("memops", 0, 64 << 10),
    ("off", 0, 0)])
def test_each_form_that_may_run_has_its_slots(monkeypatch: pytest.MonkeyPatch, mode: str,
                                              kernel: int, staged: int) -> None:
    monkeypatch.setenv("GPURING_CUDA_FUSED", mode)
    slots = Slots.for_limit(64 << 10, MOST)
    assert slots == Slots(kernel, staged)
    assert slots.region_bytes() == (_kernels.FUSED_DATA + 2 * (kernel + staged)
                                    if kernel + staged else 0)
    assert slots.staged_at() == _kernels.FUSED_DATA + 2 * kernel


def test_the_forms_keep_their_state_apart() -> None:
    """The memops form's counter and inbox lie after the kernel form's (its calls done and
    blocks done words, then MAX_BLOCKS x MAX_RANKS inbox words) and before the slots."""
    kernel_inbox_end = _kernels.FUSED_INBOX + 8 * _kernels.FUSED_MAX_BLOCKS * \
        _kernels.FUSED_MAX_RANKS
    assert 12 <= _cuda_fused._STAGED_DONE < _kernels.FUSED_INBOX
    assert kernel_inbox_end <= _cuda_fused._STAGED_INBOX
    assert _cuda_fused._STAGED_INBOX + 8 * _kernels.FUSED_MAX_RANKS <= _kernels.FUSED_DATA


def test_auto_where_ranks_share_a_gpu_records_the_kernel_form(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPURING_CUDA_FUSED", "auto")
    forms = choose(_handles(["gpu0", "gpu0"]), Slots.for_limit(64 << 10, MOST), MOST)
    assert forms.form == "memops" and forms.blocks == 24
    assert forms.capabilities.fused_kinds == {"all_reduce"}
    assert forms.capabilities.graph_kinds == KINDS and forms.capabilities.whole_pieces
    forms = choose(_handles(["gpu0", "gpu1"]), Slots.for_limit(64 << 10, MOST), MOST)
    assert forms.form == "kernel" and forms.capabilities.graph_kinds == KINDS
    assert forms.capabilities.fused_kinds == KINDS
    forms = choose(_handles(["gpu0", "gpu0"], memops=False), Slots.for_limit(64 << 10, MOST),
                   MOST)
    assert forms.form == "kernel" and forms.capabilities.graph_kinds == KINDS


@pytest.mark.parametrize("mode", ["memops", "off"])
def test_memops_and_off_record_nothing(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv("GPURING_CUDA_FUSED", mode)
    handles = _handles(["gpu0", "gpu0"])
    if mode == "off":
        handles = [h._replace(fused_blocks=0) for h in handles]  # (never compiled then)
    forms = choose(handles, Slots.for_limit(64 << 10, MOST), MOST)
    assert forms.form == mode and forms.capabilities.graph_kinds == frozenset()


class _Device:
    """What `prepare_fused` asks of a device: here, of the job's forms only."""

    def __init__(self, form: str, slots: Slots):
        self.fused_form, self.slots, self.fused_blocks = form, slots, 4
        self.captured = False


def test_a_graph_gets_the_kernel_form_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_fused(graph=True) in the memops form is the kernel (one, or one per piece),
    and the first capture of it in a process warns that it spins."""
    def made(form: str) -> object:
        return lambda device, kind, regions, rank, root, slot, *rest: (form, slot)

    monkeypatch.setattr(_cuda_fused, "FusedKernel", made("one"))
    monkeypatch.setattr(_cuda_fused, "PiecedKernel", made("pieces"))
    device = _Device("memops", Slots(1 << 20, 64 << 10))
    got = [_cuda_fused.prepare_fused(device, "all_reduce", [], 0, 0,  # type: ignore[arg-type]
                                     "float32", ReduceOp.SUM, 1, nbytes, graph=True)
           for nbytes in (4096, 2 << 20)]
    assert got == [("one", 1 << 20), ("pieces", 1 << 20)]
    with pytest.raises(ValueError, match="no one-operation"):  # outside graphs: its slot
        _cuda_fused.prepare_fused(device, "all_reduce", [], 0, 0,  # type: ignore[arg-type]
                                  "float32", ReduceOp.SUM, 1, 128 << 10)
    monkeypatch.setattr(_cuda_forms, "_warned_spins", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _cuda_fused._captured(device)  # type: ignore[arg-type]
    assert device.captured
    assert [str(w.message).count("spin") > 0 for w in caught] == [True]
    kernel = _Device("kernel", Slots(1 << 20, 0))
    monkeypatch.setattr(_cuda_forms, "_warned_spins", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _cuda_fused._captured(kernel)  # type: ignore[arg-type]
    assert not caught  # the kernel form outside graphs too: nothing to say
