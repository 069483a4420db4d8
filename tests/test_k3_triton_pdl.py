"""Programmatic dependent launch of the K3 step's Triton kernels (and the drafter's) (kernels/triton_common.PDL, off by
default; docs/kernels.md §5), checked without a GPU:

- every host function of the step's Triton kernels launches with PDL=True and launch_pdl=True when
  the switch is on, and with PDL=False and no launch_pdl when it is off;
- compiled for sm_90 (Triton's own ptxas, no device), a kernel's PTX has griddepcontrol.wait before
  its first global load and griddepcontrol.launch_dependents with the switch on, and neither off;
- every one of them compiles for sm_90 and sm_100 as its host function launches it (CI's only
  compile of these kernels: the interpreter that runs them on the CPU does not type-check).
"""
import importlib

import pytest
import torch

from dspark.kernels import triton_common

triton = pytest.importorskip("triton")


class Recorder:
    """Stands in for a kernel module: every kernel launch records (package, kernel name, positional
    arguments, keyword arguments) in `calls`."""

    def __init__(self):
        self.calls = []
        self.package = None

    @property
    def launches(self) -> list[tuple[str, dict]]:
        """(kernel name, keyword arguments) of every launch."""
        return [(name, kwargs) for _, name, _, kwargs in self.calls]

    def __getattr__(self, name):
        recorder, package = self, self.package

        class Launcher:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: recorder.calls.append((package, name, args, kwargs))

        return Launcher()


def _recorder_for(recorder):
    def kernel_module(package):
        recorder.package = package
        return recorder
    return kernel_module


def launch_every_kernel(monkeypatch, dtype=torch.float32) -> Recorder:
    """Every host function of the step's Triton kernels, called once on CPU tensors of `dtype`
    (the kernels are recorded, not run)."""
    recorder = Recorder()
    modules = [importlib.import_module(f"dspark.kernels.{op}.triton") for op in ("rmsnorm", "activation", "moe", "mla")]
    for module in modules:
        monkeypatch.setattr(module, "kernel_module", _recorder_for(recorder))
    norm, act, moe, mla = modules
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x = torch.randn(4, 64, generator=gen)
    w = torch.rand(64, generator=gen) + 0.5
    norm.rms_norm(x, w, 1e-6)
    norm.attn_res_mix_norm(x, torch.randn(2, 4, 64, generator=gen), w, w, w, 1e-6)
    norm.add_attn_res_mix_norm(x, x, torch.randn(2, 4, 64, generator=gen), w, w, w, 1e-6)
    act.situ_glu(x, x, 4.0, 25.0)
    act.sigmoid_gate(x, x)
    act.silu_mul(x, x)
    norm.add_rms_norm(x, x, w, 1e-6)
    moe.route_logits(torch.randn(4, 32, generator=gen), torch.randn(32, generator=gen), 4, 1.0)
    for rows in range(1, moe.GEMV_MAX_ROWS_BUILT + 1):  # every row tile of the router's logits kernel
        moe.router_logits_gemv(torch.randn(rows, 64, generator=gen), torch.randn(40, 64, generator=gen))
    moe.weighted_combine(torch.randn(16, 64, generator=gen), torch.randperm(16, generator=gen).view(4, 4),
                         torch.rand(4, 4, generator=gen))
    moe.gather_tokens(x, torch.randint(0, 4, (3, 2), generator=gen), torch.randperm(16, generator=gen), 3)
    moe.moe_tail_inputs(x, w, torch.randn(4, 24, generator=gen), 16, 32, 1e-6, 4.0, 25.0)
    index = torch.tensor([0, 1])
    mla.mla_cache_rows(torch.randn(4, 72, generator=gen), w, 1e-6, torch.randn(2, 9, 72, generator=gen), index,
                       index, index)
    # with the query's norm (Q_NORM): c_q strided rows of the q_a | kv_a GEMM's output
    mla.mla_cache_rows(torch.randn(4, 72, generator=gen), w, 1e-6, torch.randn(2, 9, 72, generator=gen), index,
                       index, index, q=(torch.randn(4, 48, generator=gen)[:, 4:44], torch.rand(40, generator=gen)))
    mla.mla_absorb_q(torch.randn(4, 2, 24, generator=gen), torch.randn(2, 32, 16, generator=gen))
    # the drafter's RoPE inside both (its tables: float32 [rows, P / 2])
    rope = (torch.rand(4, 4, generator=gen), torch.rand(4, 4, generator=gen), True)
    mla.mla_cache_rows(torch.randn(4, 72, generator=gen), w, 1e-6, torch.randn(2, 9, 72, generator=gen), index,
                       index, index, rope)
    mla.mla_absorb_q(torch.randn(4, 2, 24, generator=gen), torch.randn(2, 32, 16, generator=gen), rope)
    mla.mla_absorb_output(torch.randn(4, 2, 32, generator=gen), torch.randn(2, 16, 32, generator=gen),
                          torch.randn(4, 32, generator=gen))
    return recorder


@pytest.mark.parametrize("on", [False, True])
def test_every_step_kernel_launches_with_the_switch(monkeypatch, on):
    monkeypatch.setattr(triton_common, "PDL", on)
    launches = launch_every_kernel(monkeypatch).launches
    assert {name for name, _ in launches} == {
        "rms_norm_kernel", "attn_res_mix_norm_kernel", "situ_glu_kernel", "sigmoid_gate_kernel", "route_kernel",
        "router_logits_kernel", "combine_kernel", "gather_tokens_kernel", "tail_inputs_kernel", "cache_rows_kernel", "absorb_kernel",
        "silu_mul_kernel", "add_rms_norm_kernel"}
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
                                        "stride_o": "i32", "d": "i32", "eps": "fp32"}, {"BLOCK": 8192, "SCALE_IN_FP32": False}),
        (mla_kernels.cache_rows_kernel, {"kv_ptr": "*bf16", "stride_kv": "i32", "w_ptr": "*bf16", "cache_ptr": "*bf16",
                                         "stride_slot": "i64", "stride_row": "i32", "slots_ptr": "*i64",
                                         "cache_lens_ptr": "*i64", "lengths_ptr": "*i64", "cos_ptr": "*fp32",
                                         "sin_ptr": "*fp32", "stride_rope": "i32", "q_ptr": "*bf16", "stride_q": "i32",
                                         "q_w_ptr": "*bf16", "q_out_ptr": "*bf16", "T": "i32", "R": "i32", "P": "i32",
                                         "Q": "i32", "spare": "i32", "eps": "fp32", "stride_kv_s": "i32",
                                         "stride_q_s": "i32"},
         {"BLOCK_R": 512, "BLOCK_P": 64, "BLOCK_Q": 2048, "ROPE": False, "INTERLEAVED": False, "Q_NORM": True,
          "PARTS": 1}),
    ]
    for kernel, signature, constexprs in cases:
        ptx = _ptx(kernel, signature, constexprs, pdl)
        assert ("griddepcontrol.wait" in ptx) is pdl and ("griddepcontrol.launch_dependents" in ptx) is pdl
        if pdl:
            assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


_POINTER_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
                  torch.int32: "i32", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}


def _signature(kernel, args: tuple, kwargs: dict, float_pointer: str | None) -> tuple[dict, dict]:
    """The signature and constexprs Triton's launcher would build from a recorded launch: a tensor
    is a pointer to its dtype (every floating one to `float_pointer` when given), an int i32 or i64
    by its size, a float fp32; keyword arguments that name parameters are the constexprs."""
    signature = {}
    for name, value in zip(kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            kind = _POINTER_TYPES[value.dtype]
            signature[name] = "*" + (float_pointer if float_pointer and value.is_floating_point() else kind)
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} has an unexpected type {type(value).__name__}")
    constexprs = {name: value for name, value in kwargs.items() if name in kernel.arg_names}
    signature.update({name: "constexpr" for name in constexprs})
    missing = [name for name in kernel.arg_names if name not in signature]
    assert not missing, f"{kernel.__name__}: parameters not passed by the launch: {missing}"
    return signature, constexprs


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("arch", [90, 100])
def test_every_step_kernel_compiles_as_launched(monkeypatch, arch, pdl):
    """Each of the step's Triton kernels, compiled (Triton's front end and its ptxas, no device) with
    the constexprs and argument types its host function launches it with, for Hopper and Blackwell,
    with fp32 and with bf16 tensors. A kernel that the interpreter runs can still fail to compile
    (Triton types each name across both branches of an `if`): this is where that shows first."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setattr(triton_common, "PDL", pdl)
    calls = launch_every_kernel(monkeypatch).calls
    compiled = set()
    for package, name, args, kwargs in calls:
        kernel = getattr(importlib.import_module(f"{package}.triton_kernels"), name)
        options = {key: kwargs[key] for key in ("num_warps", "num_stages", "launch_pdl") if key in kwargs}
        for float_pointer in (None, "bf16"):
            signature, constexprs = _signature(kernel, args, kwargs, float_pointer)
            ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                 target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]
            assert f".target sm_{arch}" in ptx, name
            compiled.add(name)
    assert compiled == {name for _, name, _, _ in calls} and len(compiled) == 13
