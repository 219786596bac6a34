"""Stacks whose PyTorch wheels carry no kernels for a GPU (boom_ml/stack_archs.csv): the
rows' cases, the variants that do run, and the one note per reason the table prints."""

from __future__ import annotations

import pytest

from boom_ml.gpus import get_gpu
from boom_ml.stack import kernels_missing, resolve_stack, running_variants, stack_missing


@pytest.mark.parametrize(
    ("stack", "sm", "words"),
    [({}, 70, "CUDA 13 targets Turing (sm_75) and newer"),  # the default: 2.14 + CUDA 13.0
     ({}, 75, None),
     ({"torch": "1.12"}, 90, "before 11.8 compile for sm_86 at most"),
     ({"torch": "1.12"}, 89, None),  # Ada runs the sm_86 code (same major, higher minor)
     ({"torch": "2.0", "cuda": "11.8"}, 90, None),
     ({"torch": "2.6", "cuda": "12.6"}, 100, "Blackwell needs CUDA 12.8"),
     ({"torch": "2.8", "cuda": "12.8"}, 61, "dropped Maxwell and Pascal from 2.8"),
     ({"torch": "2.7", "cuda": "12.8"}, 61, None),
     ({"torch": "2.11", "cuda": "12.8"}, 70, "dropped Volta from 2.11"),
     ({"torch": "2.10", "cuda": "12.8"}, 70, None)],
)  # fmt: skip
def test_which_stacks_have_no_kernels_for_an_architecture(stack, sm, words) -> None:
    why = kernels_missing(resolve_stack(stack), sm)
    assert why == words if words is None else words in why


def test_the_variants_that_run_and_the_note() -> None:
    default = resolve_stack({})
    assert (default.torch, default.cuda) == ("2.14", "13.0")
    assert running_variants(default, 70) == ["12.6"]
    assert running_variants(resolve_stack({"torch": "1.12"}), 90) == []
    assert stack_missing(default, get_gpu("t4")) is None
    assert stack_missing(default, get_gpu("v100-sxm2-32gb")) == (
        "torch 2.14 + CUDA 13.0 has no kernels for v100-sxm2-32gb (CUDA 13 targets Turing "
        "(sm_75) and newer), predicted as if it ran; torch 2.14 with CUDA 12.6 runs there "
        "(stack.cuda=12.6)"
    )


def test_the_table_names_the_gpus_of_one_reason_once() -> None:
    import boom_ml
    from boom_ml.report.table import stack_missing_lines

    p = boom_ml.predict("torchvision:resnet18", gpu=["p100-pcie-16gb", "t4", "v100-sxm2-32gb"],
                        batch_size=2, image_size=32, advice=False, max_batch="off")  # fmt: skip
    assert [g.to_dict()["stack_missing"] is None for g in p.gpus] == [False, True, False]
    (line,) = stack_missing_lines([(g.gpu, g.stack_missing) for g in p.gpus])
    assert line.startswith("Note: torch 2.14 + CUDA 13.0 has no kernels for p100-pcie-16gb, "
                           "v100-sxm2-32gb (CUDA 13")  # fmt: skip


def test_a_layout_on_such_a_gpu_says_so_too() -> None:
    import boom_ml
    from boom_ml.report.table import render_table

    p = boom_ml.predict("hf:gpt2", gpu=["v100-sxm2-32gb", "t4"], batch_size=2, seq_len=64,
                        parallel={"dp": 2}, advice=False)  # fmt: skip
    assert [e["stack_missing"] is None for e in p.parallel] == [False, True]
    assert "Note: torch 2.14 + CUDA 13.0 has no kernels for v100-sxm2-32gb (" in render_table(p)


def test_a_pasted_torch_version_names_its_cuda_wheel() -> None:
    """``stack.torch=2.6.0+cu118`` (torch.__version__ as printed) is the CUDA 11.8 wheel; its tag
    was dropped and the release's default CUDA (12.4) used without a word."""
    from boom_ml.errors import InvalidInputError

    tagged = resolve_stack({"torch": "2.6.0+cu118"})
    assert (tagged.torch, tagged.cuda) == ("2.6", "11.8")
    assert resolve_stack({"torch": "2.6.0+cu118", "cuda": "11.8"}) == tagged
    for options, words in (({"torch": "2.6.0+cpu"}, "'\\+cpu' is no CUDA wheel"),
                           ({"torch": "2.6.0+cu118", "cuda": "12.4"}, "is a CUDA 11.8 wheel")):  # fmt: skip
        with pytest.raises(InvalidInputError, match=words):
            resolve_stack(options)


def test_a_release_takes_its_pypi_cuda_variant_where_one_is_sourced() -> None:
    """torch 2.4 from PyPI is the CUDA 12.1 wheel (2.5 moved PyPI to 12.4 "rather than 12.1");
    the table had no default for it and took its first row, 11.8. Where no source says (1.12,
    2.3), the first row stays and the row's source says so."""
    assert (resolve_stack({"torch": "2.4"}).cuda, resolve_stack({"torch": "2.5"}).cuda) == (
        "12.1",
        "12.4",
    )
    assert resolve_stack({"torch": "2.3"}).cuda == "11.8"


def test_a_1x_stack_says_which_zero_grad_the_step_used() -> None:
    """torch 1.13's zero_grad() zeroed in place; a hunt found a 1.13 stack silently timed with
    2.x's set_to_none. Said once, and not where the step zeroes in place or runs 2.x."""
    import boom_ml
    from boom_ml.report.table import render_table

    kw = dict(model="torchvision:resnet18", gpu="l4", batch_size=2, image_size=32,
              advice=False, max_batch="off")  # fmt: skip
    note = "Note: zero_grad=set_to_none, PyTorch 2.x's default; torch 1.13's zero_grad() zeroes"
    assert note in render_table(boom_ml.predict(stack={"torch": "1.13"}, **kw))
    assert note not in render_table(
        boom_ml.predict(stack={"torch": "1.13"}, zero_grad="zero", **kw)
    )
    assert "Note: zero_grad=" not in render_table(boom_ml.predict(**kw))


def test_an_unknown_cudnn_lists_the_known_ones_in_version_order() -> None:
    from boom_ml.errors import InvalidInputError

    with pytest.raises(InvalidInputError) as err:
        resolve_stack({"cudnn": "1.0"})
    text = str(err.value)  # 9.5 before 9.10 (it had sorted them as text)
    assert text.index("9.5.1.17") < text.index("9.7.1.26") < text.index("9.10.2.21")
