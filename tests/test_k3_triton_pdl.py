"""Programmatic dependent launch of the K3 step's Triton kernels (kernels/triton_common.PDL, off by
default; docs/kernels.md §5), checked without a GPU:

- every host function of the step's Triton kernels launches with PDL=True and launch_pdl=True when
  the switch is on, and with PDL=False and no launch_pdl when it is off;
- compiled for sm_90 (Triton's own ptxas, no device), a kernel's PTX has griddepcontrol.wait before
  its first global load and griddepcontrol.launch_dependents with the switch on, and neither off.
"""
import importlib

import pytest
import torch

from dspark.kernels import triton_common

triton = pytest.importorskip("triton")


class Recorder:
    """Stands in for a kernel module: every kernel launch records (kernel name, keyword arguments)."""

    def __init__(self):
        self.launches = []

    def __getattr__(self, name):
        recorder = self

        class Launcher:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: recorder.launches.append((name, kwargs))

        return Launcher()


def launch_every_kernel(monkeypatch) -> list:
    recorder = Recorder()
    modules = [importlib.import_module(f"dspark.kernels.{op}.triton") for op in ("rmsnorm", "activation", "moe", "mla")]
    for module in modules:
        monkeypatch.setattr(module, "kernel_module", lambda package: recorder)
    norm, act, moe, mla = modules
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x = torch.randn(4, 64, generator=gen)
    w = torch.rand(64, generator=gen) + 0.5
    norm.rms_norm(x, w, 1e-6)
    norm.attn_res_mix_norm(x, torch.randn(2, 4, 64, generator=gen), w, w, w, 1e-6)
    norm.add_attn_res_mix_norm(x, x, torch.randn(2, 4, 64, generator=gen), w, w, w, 1e-6)
    act.situ_glu(x, x, 4.0, 25.0)
    act.sigmoid_gate(x, x)
    moe.route_logits(torch.randn(4, 32, generator=gen), torch.randn(32, generator=gen), 4, 1.0)
    moe.weighted_combine(torch.randn(16, 64, generator=gen), torch.randperm(16, generator=gen).view(4, 4),
                         torch.rand(4, 4, generator=gen))
    moe.gather_tokens(x, torch.randint(0, 4, (3, 2), generator=gen), torch.randperm(16, generator=gen), 3)
    moe.moe_tail_inputs(x, w, torch.randn(4, 24, generator=gen), 16, 32, 1e-6, 4.0, 25.0)
    index = torch.tensor([0, 1])
    mla.mla_cache_rows(torch.randn(4, 72, generator=gen), w, 1e-6, torch.randn(2, 9, 72, generator=gen), index,
                       index, index)
    mla.mla_absorb_q(torch.randn(4, 2, 24, generator=gen), torch.randn(2, 32, 16, generator=gen))
    mla.mla_absorb_output(torch.randn(4, 2, 32, generator=gen), torch.randn(2, 16, 32, generator=gen),
                          torch.randn(4, 32, generator=gen))
    return recorder.launches


@pytest.mark.parametrize("on", [False, True])
def test_every_step_kernel_launches_with_the_switch(monkeypatch, on):
    monkeypatch.setattr(triton_common, "PDL", on)
    launches = launch_every_kernel(monkeypatch)
    assert {name for name, _ in launches} == {
        "rms_norm_kernel", "attn_res_mix_norm_kernel", "situ_glu_kernel", "sigmoid_gate_kernel", "route_kernel",
        "combine_kernel", "gather_tokens_kernel", "tail_inputs_kernel", "cache_rows_kernel", "absorb_kernel"}
    for name, kwargs in launches:
        assert kwargs["PDL"] is on, name
        assert kwargs.get("launch_pdl", False) is on, name


def _ptx(kernel, signature: dict, constexprs: dict, pdl: bool) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature={**signature, **{k: "constexpr" for k in constexprs}, "PDL": "constexpr"},
                       constexprs={**constexprs, "PDL": pdl})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": pdl})
    assert compiled.metadata.launch_pdl is pdl
    return compiled.asm["ptx"]


@pytest.mark.parametrize("pdl", [False, True])
def test_the_prologue_waits_before_the_first_load(pdl):
    from dspark.kernels.mla import triton_kernels as mla_kernels
    from dspark.kernels.rmsnorm import triton_kernels as norm_kernels

    cases = [
        (norm_kernels.rms_norm_kernel, {"x_ptr": "*bf16", "stride_x": "i32", "w_ptr": "*bf16", "out_ptr": "*bf16",
                                        "stride_o": "i32", "d": "i32", "eps": "fp32"}, {"BLOCK": 8192}),
        (mla_kernels.cache_rows_kernel, {"kv_ptr": "*bf16", "stride_kv": "i32", "w_ptr": "*bf16", "cache_ptr": "*bf16",
                                         "stride_slot": "i64", "stride_row": "i32", "slots_ptr": "*i64",
                                         "cache_lens_ptr": "*i64", "lengths_ptr": "*i64", "T": "i32", "R": "i32",
                                         "P": "i32", "spare": "i32", "eps": "fp32"}, {"BLOCK_R": 512, "BLOCK_P": 64}),
    ]
    for kernel, signature, constexprs in cases:
        ptx = _ptx(kernel, signature, constexprs, pdl)
        assert ("griddepcontrol.wait" in ptx) is pdl and ("griddepcontrol.launch_dependents" in ptx) is pdl
        if pdl:
            assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
