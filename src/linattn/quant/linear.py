"""`QuantizedLinear`: a linear layer whose weight is stored in 8 or 4 bits, for CPU inference.

Formats (symmetric, no zero point, every scale a bf16 value rounded up so that no weight is clipped):

    int8   q = round(w / s) in [-127, 127], s = max|w_row| / 127 per output row (channel)
    int4   q = round(w / s) in [-7, 7],     s = max|w_group| / 7 per row and group of `group_size` inputs

so every dequantized weight q * s is within s / 2 of the original. The int4 values are stored as q + 8 in
[1, 15], two per byte (low nibble: the even input column). Products run in PyTorch's CPU kernels: for a few
rows (decoding) the packed matmuls `torch._weight_int8pack_mm` / `torch._weight_int4pack_mm_for_cpu` with bf16
activations (their fp32-activation paths are 3-60x slower than an fp32 matmul on the CPU measured); for many
rows (prefill, above `PACKED_MAX_ROWS`) the weight is dequantized to bf16 and multiplied by torch's bf16
matmul, which is faster there (numbers in docs/quantization.md). On a CPU without bf16 instructions (no AVX512-BF16
or AMX-BF16: `native_bf16`) torch's bf16 matmul is ~5x slower than its fp32 one, so above
`PACKED_MAX_ROWS_NO_BF16` the same bf16 operands (x and the dequantized weight rounded to bf16) are multiplied
by torch's fp32 matmul instead, the weight dequantized a block of rows at a time, and the output rounded to bf16:
only the fp32 accumulation order differs from the bf16 matmul's (`product_path`). `compute="fp32"` dequantizes to
fp32 (fp64 for fp64 inputs) instead: slower, without the bf16 rounding of activations and outputs. Dequantizing to
fp32 or bf16 runs on a compiled kernel (cpu/dequant.py, the same bits) where the CPU kernels build, else on torch's
elementwise ops.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..cpu import dequant as cpu_dequant
from ..errors import LinattnError, LinattnTypeError

MODES = ("int8", "int4")
GROUP_SIZES = (32, 64)
COMPUTES = ("bf16", "fp32")
ACTIVATIONS = ("float", "int8")
#: what each mode's products take when `activations` is not given: both round x to int8 (their integer products
#: read at the memory's rate, where int4's fp32-activation products, a table shuffle per 16 weights, compute slower
#: than that and int8's are slower too; perplexity within 0.1 % of weight-only's: docs/quantization.md)
DEFAULT_ACTIVATIONS = {"int8": "int8", "int4": "int8"}
ACTIVATION_BLOCK = 32     # int8 activations: inputs sharing one scale (csrc/qmatvec.h A8_BLOCK)
INT4_N_MULTIPLE = 16      # torch's int4 CPU packing needs out_features % 16 == 0
# up to this many rows the packed kernels beat dequantize-then-bf16-matmul (`linattn bench quant --kernels`, a
# 1024 x 3584 weight, 1 thread: int8 ties at 64 rows and loses 4x at 512; int4 wins at 64, loses at 512)
PACKED_MAX_ROWS = {"int8": 48, "int4": 128}
# the same on a CPU without bf16 instructions, where the many-rows path is dequantize-then-fp32-matmul
# (`product_path`), the weight dequantized by the compiled kernel (cpu/dequant.py: ~1 ms a 3.6M-weight matrix against
# torch's elementwise ops' 2-3.5 (int8) and 7-9 ms (int4)). Measured on an AMD EPYC (Zen 3, AVX2), 1 thread, thread
# CPU time alternated (load 7), packed / fp32 path, 3584 x 1024 and 1024 x 3584 weights: int8 0.97 and 0.82 at 24
# rows, 1.09 and 0.99 at 32, 1.21 and 1.05 at 40; int4 1.00 and 0.76 at 24, 1.03 and 0.98 at 32, 1.13 and 1.21 at 40
# (docs/quantization.md). Without a C compiler torch's ops dequantize, and int4's packed kernel would win up to ~128
# rows (the fp32 path ~10 % slower there); the choice stays a function of the CPU only
PACKED_MAX_ROWS_NO_BF16 = {"int8": 32, "int4": 32}
#: the fp32 path dequantizes this many weights at a time (2 MiB of fp32, a block of rows), multiplying each block
#: while it is in cache: int8 at 64 rows 11.2 against 15.5 ms dequantizing the whole 3584 x 1024 weight first
PREFILL_BLOCK_WEIGHTS = 1 << 19
_QMAX = {"int8": 127, "int4": 7}


def check_mode(mode, group_size) -> Optional[int]:
    """Validate (mode, group_size); returns the group size in use (None for int8)."""
    if mode not in MODES:
        raise LinattnError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "int8":
        if group_size is not None:
            raise LinattnError(f"group_size applies to int4 only (int8 has one scale per output row), "
                               f"got {group_size!r}")
        return None
    group_size = 32 if group_size is None else group_size
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise LinattnError(f"group_size must be one of {GROUP_SIZES} for int4, got {group_size!r}")
    return int(group_size)


def check_compute(compute) -> str:
    if compute not in COMPUTES:
        raise LinattnError(f"compute must be one of {COMPUTES}, got {compute!r}")
    return compute


def check_activations(activations, mode: str) -> str:
    """The activations in use: `activations`, or mode's default (`DEFAULT_ACTIVATIONS`) for None; mode checked
    before."""
    if activations is None:
        return DEFAULT_ACTIVATIONS[mode]
    if activations not in ACTIVATIONS:
        raise LinattnError(f"activations must be one of {ACTIVATIONS} (or None: int8), "
                           f"got {activations!r}")
    return activations


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per block of 32 consecutive inputs (the last dim), as the compiled products round it.

    A block's scale is s = max|x| / 127 (in fp32, fp64 for fp64 x; raised by ulps until 127 s >= the max), each
    value q = round(x / s) in [-127, 127], ties to even; returns q * s in x's dtype (fp32 for bf16 / fp16 x, whose
    products compute in fp32). A tensor with a NaN or inf is returned unrounded: its products run exact, as the
    compiled ones do (csrc/qmatvec.h). |x - q s| <= s / 2 elementwise.
    """
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(dt)
    if x.numel() == 0 or not bool(torch.isfinite(x).all()):
        return x
    K = x.shape[-1]
    nb = -(-K // ACTIVATION_BLOCK)
    blocks = F.pad(x, (0, nb * ACTIVATION_BLOCK - K)).unflatten(-1, (nb, ACTIVATION_BLOCK))
    mx = blocks.abs().amax(-1, keepdim=True)
    s = mx / 127
    inf = torch.full_like(s, float("inf"))
    while True:   # at most a few ulps, near the smallest floats
        low = s * 127 < mx
        if not bool(low.any()):
            break
        s = torch.where(low, torch.nextafter(s, inf), s)
    q = torch.where(s > 0, torch.round(blocks / torch.where(s > 0, s, torch.ones_like(s))), torch.zeros_like(blocks))
    return (q.clamp_(-127, 127) * s).flatten(-2)[..., :K]


@functools.lru_cache(maxsize=None)
def native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 or AMX-BF16, as torch's CPU probe reports them),
    probed once. Without them torch's bf16 matmul converts to fp32 and runs ~5x slower than its fp32 matmul (an AMD
    Zen 3, docs/quantization.md), so the many-rows products take the fp32 path (`product_path`). CPUs torch's
    probe does not describe (not x86) count as without: the fp32 path is never the slow one."""
    try:
        caps = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):   # (a torch without the probe)
        return False
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def product_path(mode: str, rows: int, bf16_instructions: bool) -> str:
    """Which kernel a `compute="bf16"` product of `rows` rows runs: "packed" (torch's packed int8 / int4 kernel),
    "bf16" (the weight dequantized to bf16, torch's bf16 matmul) or "fp32" (the same bf16-rounded operands in
    torch's fp32 matmul, the output rounded to bf16). A function of the mode, the rows and the CPU's capability
    (`native_bf16`) only, never of a timing: every run on one CPU computes the same way."""
    if bf16_instructions:
        return "packed" if rows <= PACKED_MAX_ROWS[mode] else "bf16"
    return "packed" if rows <= PACKED_MAX_ROWS_NO_BF16[mode] else "fp32"


def fits(mode: str, group_size: Optional[int], out_features: int, in_features: int) -> Optional[str]:
    """Why a weight of this shape cannot take this format (None when it can)."""
    if mode == "int4" and in_features % group_size:
        return f"in_features {in_features} is not a multiple of group_size {group_size}"
    if mode == "int4" and out_features % INT4_N_MULTIPLE:
        return f"out_features {out_features} is not a multiple of {INT4_N_MULTIPLE} (torch's int4 CPU packing)"
    return None


def _bf16_scale_up(s: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 values >= s (fp32 -> bf16), at least bf16's smallest normal (all-zero rows)."""
    tiny = torch.finfo(torch.bfloat16).tiny
    s = s.float().clamp_min(tiny)
    b = s.to(torch.bfloat16)
    return torch.where(b.float() < s, torch.nextafter(b, torch.full_like(b, float("inf"))), b)


def quantize_weight(weight: torch.Tensor, mode: str, group_size: Optional[int]):
    """A float weight `[N, K]` -> (q int8 `[N, K]` in [-qmax, qmax], scales bf16 `[N]` (int8) or `[N, K/G]`)."""
    w = weight.detach().to(torch.float64)
    N, K = w.shape
    qmax = _QMAX[mode]
    groups = w.view(N, 1, K) if mode == "int8" else w.view(N, K // group_size, group_size)
    scales = _bf16_scale_up(groups.abs().amax(-1) / qmax)
    q = torch.round(groups / scales.double().unsqueeze(-1)).clamp_(-qmax, qmax).to(torch.int8).view(N, K)
    return q, (scales.view(N) if mode == "int8" else scales)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values q `[N, K]` in [-8, 7] -> uint8 `[N, K/2]` of q + 8, the even column in the low nibble."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse: uint8 `[N, K/2]` -> int8 `[N, K]`."""
    lo, hi = packed & 15, packed >> 4
    return (torch.stack((lo, hi), -1).view(packed.shape[0], -1).to(torch.int16) - 8).to(torch.int8)


class _NoBackward(torch.autograd.Function):
    """Runs the quantized product; refuses gradients (the weights are frozen integers, not parameters)."""

    @staticmethod
    def forward(ctx, x, layer):
        return layer._product(x)

    @staticmethod
    def backward(ctx, grad):
        raise LinattnError("backward through quantized weights is not supported: a quantized model is for "
                           "inference (run it under torch.no_grad(), or train the float model and quantize after)")


def _rederive_after_load(module, incompatible_keys) -> None:
    module._derive_int4_layout()


class WeightInfo(NamedTuple):
    """What code written for an `nn.Linear` reads of its `weight` without multiplying by it (`x.to(head.weight.dtype)`
    in transformers' `Mamba2ForCausalLM`), for a `QuantizedLinear`: the float dtype its inputs come in, the device,
    the shape. Not a tensor: a product through it (`F.linear(x, layer.weight)`) fails with a TypeError."""

    dtype: torch.dtype
    device: torch.device
    shape: torch.Size


class QuantizedLinear(nn.Module):
    """y = x Wᵀ + b with W stored in int8 (per output row) or int4 (per group of inputs); CPU only.

    Not an `nn.Linear`: its `weight` is not a tensor but a `WeightInfo` (the dtype, device and shape that code
    written for an `nn.Linear` reads without multiplying by the matrix, as transformers' `Mamba2ForCausalLM` casts
    its hidden states to `lm_head.weight.dtype`), so no code path that multiplies by a float weight can take it by
    mistake.
    Build one with `QuantizedLinear.from_linear` or `linattn.quantize`.

    Args:
        qweight: int8 `[N, K]` (int8 mode) or uint8 `[N, K/2]` (int4, two values per byte, `pack_int4`).
        scales: bf16 `[N]` (int8) or `[N, K/group_size]` (int4).
        bias: `[N]` or None (kept in fp32).
        mode: "int8" or "int4".
        group_size: int4's group (32 or 64); None for int8.
        compute: "bf16" (PyTorch's packed kernels, bf16 activations) or "fp32" (dequantize to fp32).
        activations: "float" (the products take x as it is) or "int8": every product first rounds x to int8 per
            block of 32 inputs (`round_activations`); the compiled decode then multiplies integers. None (default):
            "int8" (`DEFAULT_ACTIVATIONS`).

    Raises:
        LinattnError: A bad mode, group size, compute, activations or shape, or a tensor not on the CPU.
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor], mode: str,
                 group_size: Optional[int] = None, compute: str = "bf16", activations: Optional[str] = None):
        super().__init__()
        group_size = check_mode(mode, group_size)
        self.mode, self.group_size, self.compute = mode, group_size, check_compute(compute)
        self.activations = check_activations(activations, mode)
        N = qweight.shape[0]
        K = qweight.shape[1] * (2 if mode == "int4" else 1)
        want_q = (torch.int8 if mode == "int8" else torch.uint8, (N, qweight.shape[1]))
        want_s = (N,) if mode == "int8" else (N, K // group_size)
        if (qweight.dim() != 2 or (qweight.dtype, tuple(qweight.shape)) != want_q
                or tuple(scales.shape) != want_s or (bias is not None and tuple(bias.shape) != (N,))):
            k = "K/2" if mode == "int4" else "K"
            raise LinattnError(f"QuantizedLinear ({mode}): qweight must be {want_q[0]} [N, {k}], "
                               f"scales {list(want_s)} and bias [{N}] or None; got qweight "
                               f"{qweight.dtype} {list(qweight.shape)}, scales {list(scales.shape)}, bias "
                               f"{None if bias is None else list(bias.shape)}")
        reason = fits(mode, group_size, N, K)
        if reason:
            raise LinattnError(f"QuantizedLinear ({mode}): {reason}")
        for name, t in (("qweight", qweight), ("scales", scales), ("bias", bias)):
            if t is not None and t.device.type != "cpu":
                raise LinattnError(f"QuantizedLinear: {name} is on {t.device}; quantized weights run on the CPU only")
        self.in_features, self.out_features = K, N
        # (an empty tensor of the float layer's dtype, which `.to()` / `.double()` convert as they convert the
        # model: `weight.dtype`; not saved)
        self.register_buffer("_float_like", torch.empty(0), persistent=False)
        # fresh (aligned, owned) copies: torch's packed kernels crash on tensors at odd offsets of a file mapping
        self.register_buffer("qweight", qweight.detach().clone(memory_format=torch.contiguous_format))
        self.register_buffer("scales", scales.detach().to(torch.bfloat16, copy=True).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32, copy=True).contiguous())
        if mode == "int4":   # torch's own packed layout, derived (not saved): again after a load_state_dict
            self._derive_int4_layout()
            self.register_load_state_dict_post_hook(_rederive_after_load)   # a named function: pickles

    def _derive_int4_layout(self) -> None:
        codes = unpack_int4(self.qweight).to(torch.int32) + 8
        self.register_buffer("_packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1), persistent=False)
        zeros = torch.zeros_like(self.scales)   # the kernel's weight: (code - 8) * scale + zero
        self.register_buffer("_scale_zeros", torch.stack((self.scales, zeros), -1).transpose(0, 1).contiguous(),
                             persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Module, mode: str, group_size: Optional[int] = None,
                    compute: str = "bf16", activations: Optional[str] = None) -> "QuantizedLinear":
        """Quantize an `nn.Linear` (its weight and bias are read, not changed).

        Args:
            linear: The float layer.
            mode: "int8" or "int4".
            group_size: int4's group (32 or 64, default 32); None for int8.
            compute: "bf16" or "fp32" (the class's Args).
            activations: "float", "int8" or None (the class's Args).

        Returns:
            The QuantizedLinear.

        Raises:
            LinattnTypeError: linear is not an nn.Linear.
            LinattnError: As `from_weight`.
        """
        if not isinstance(linear, nn.Linear):
            raise LinattnTypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        return cls.from_weight(linear.weight, linear.bias, mode, group_size, compute, activations)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: Optional[torch.Tensor], mode: str,
                    group_size: Optional[int] = None, compute: str = "bf16",
                    activations: Optional[str] = None) -> "QuantizedLinear":
        """Quantize a float weight `[out_features, in_features]` (and a bias).

        Args:
            weight: The float weight, on the CPU, finite.
            bias: `[out_features]` or None.
            mode: "int8" or "int4".
            group_size: int4's group (32 or 64, default 32); None for int8.
            compute: "bf16" or "fp32" (the class's Args).
            activations: "float", "int8" or None (the class's Args).

        Returns:
            The QuantizedLinear.

        Raises:
            LinattnError: A bad mode, group size, compute or activations, a shape the format cannot take, a weight
                off the CPU or with NaN / inf values.
        """
        group_size = check_mode(mode, group_size)
        activations = check_activations(activations, mode)
        if weight.device.type != "cpu":
            raise LinattnError(f"weight is on {weight.device}; quantized weights run on the CPU only (move the model "
                               f"to the CPU first)")
        if weight.dim() != 2 or not weight.is_floating_point():
            raise LinattnError(f"weight must be a float [out_features, in_features] matrix, got {weight.dtype} "
                               f"{list(weight.shape)}")
        reason = fits(mode, group_size, *weight.shape)
        if reason:
            raise LinattnError(f"weight {list(weight.shape)} cannot be quantized to {mode}: {reason}")
        if not bool(torch.isfinite(weight).all()):
            raise LinattnError("weight has NaN or inf values; a quantized weight must be finite")
        q, scales = quantize_weight(weight, mode, group_size)
        layer = cls(q if mode == "int8" else pack_int4(q), scales, bias, mode, group_size, compute, activations)
        layer._float_like = torch.empty(0, dtype=weight.dtype)
        return layer

    @property
    def weight(self) -> "WeightInfo":
        """The float matrix's dtype (that of the layer it replaced, converted with the model), device and shape
        `[out_features, in_features]`: a `WeightInfo`, not a tensor (the integers are `qweight`)."""
        return WeightInfo(self._float_like.dtype, self.qweight.device, torch.Size((self.out_features,
                                                                                   self.in_features)))

    def __setattr__(self, name, value):
        # (nn.Module would register a Parameter under `weight` beside the property, or fail with a bare KeyError:
        # transformers' `tie_weights` assigns the embedding's matrix to the head's `weight`)
        if name == "weight":
            raise LinattnError("a QuantizedLinear's weight cannot be assigned: its matrix is stored as "
                               f"{self.mode} rows (`qweight`, `scales`); tie or replace weights before "
                               "`linattn.quantize`")
        super().__setattr__(name, value)

    def int_weight(self) -> torch.Tensor:
        """The integer values `[N, K]` (int8)."""
        return self.qweight if self.mode == "int8" else unpack_int4(self.qweight)

    def expanded_scales(self) -> torch.Tensor:
        """The scale of every weight, `[N, K]` (bf16)."""
        if self.mode == "int8":
            return self.scales.unsqueeze(1).expand(self.out_features, self.in_features)
        return self.scales.repeat_interleave(self.group_size, dim=1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the products use, q * s.

        Args:
            dtype: The dtype to return (exact in fp32 and fp64; bf16 rounds).

        Returns:
            The dequantized weight `[out_features, in_features]`.
        """
        return self._dequantize_rows(0, self.out_features, dtype)

    def _dequantize_rows(self, lo: int, hi: int, dtype: torch.dtype, bf16_round: bool = False,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`dequantize(dtype)`'s rows lo:hi (the same bits: one rounding of the exact q * s in dtype). With
        `bf16_round` (dtype fp32): `dequantize(torch.bfloat16)`'s values in fp32, the fp32 path's operand. On the
        compiled dequantizer (cpu/dequant.py, writing into `out` when given) for fp32 and bf16 when it is
        available, else torch's elementwise ops (the reference)."""
        if dtype in (torch.float32, torch.bfloat16) and cpu_dequant.available():
            return cpu_dequant.dequantize_rows(self.mode, self.qweight[lo:hi], self.scales[lo:hi],
                                               self.group_size or 0, bf16_round, out, dtype)
        if bf16_round:
            return self._dequantize_rows_torch(lo, hi, torch.bfloat16).to(torch.float32)
        return self._dequantize_rows_torch(lo, hi, dtype)

    def _dequantize_rows_torch(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        K = self.in_features
        if self.mode == "int8":   # (in place: a broadcast out-of-place product is 3x slower in torch 2.13)
            return self.qweight[lo:hi].to(dtype).mul_(self.scales[lo:hi].to(dtype).unsqueeze(1))
        p = self.qweight[lo:hi]
        codes = torch.stack((p & 15, p >> 4), -1).view(hi - lo, K // self.group_size, self.group_size)
        return codes.to(dtype).sub_(8).mul_(self.scales[lo:hi].to(dtype).unsqueeze(-1)).view(hi - lo, K)

    def _prefill_fp32(self, xb: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """x `[M, K]` times the weight in torch's fp32 matmul (fp32 `[M, N]`), dequantized `PREFILL_BLOCK_WEIGHTS`
        at a time into one buffer: the bf16-rounded weight (`dequantize(torch.bfloat16)`, the operand of the bf16
        path), or with `exact` q * s unrounded (for `linattn bench quant --kernels`' comparison)."""
        x = xb.to(torch.float32)
        N, K = self.out_features, self.in_features
        block = min(N, max(16, PREFILL_BLOCK_WEIGHTS // K))
        y = torch.empty(x.shape[0], N, dtype=torch.float32)   # (not the default dtype, which a user may change)
        buf = torch.empty(block * K, dtype=torch.float32)
        for lo in range(0, N, block):
            hi = min(N, lo + block)
            w = self._dequantize_rows(lo, hi, torch.float32, bf16_round=not exact, out=buf)
            torch.mm(x, w.T, out=y[:, lo:hi])
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            raise LinattnError(f"QuantizedLinear: x must be a CPU tensor (quantized weights run on the CPU only), got "
                               f"{getattr(x, 'device', type(x).__name__)}")
        if x.dim() == 0 or x.shape[-1] != self.in_features or not x.is_floating_point():
            raise LinattnError(f"QuantizedLinear: x must be a float [..., {self.in_features}] tensor, got {x.dtype} "
                               f"{list(x.shape)}")
        if torch.is_grad_enabled() and x.requires_grad:
            return _NoBackward.apply(x, self)
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.activations == "int8":
            x2 = round_activations(x2)
        if self.compute == "fp32" or x2.shape[0] == 0:
            dt = torch.float64 if x.dtype == torch.float64 else torch.float32
            y = F.linear(x2.to(dt), self.dequantize(dt))
        else:
            path = product_path(self.mode, x2.shape[0], native_bf16())
            xb = x2.to(torch.bfloat16).contiguous()
            if path == "packed" and self.mode == "int8":
                y = torch._weight_int8pack_mm(xb, self.qweight, self.scales.to(torch.bfloat16))
            elif path == "packed":
                y = torch._weight_int4pack_mm_for_cpu(xb, self._packed, self.group_size,
                                                      self._scale_zeros.to(torch.bfloat16))
            elif path == "bf16":
                y = F.linear(xb, self.dequantize(torch.bfloat16))
            else:   # (a bf16 output, as the other two paths give)
                y = self._prefill_fp32(xb).to(torch.bfloat16)
        if self.bias is not None:   # in fp32 at least (the bf16 kernels' outputs), fp64 for fp64 inputs
            y = y.to(torch.promote_types(y.dtype, torch.float32)) + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def stored_weights(self):
        """What the compiled decode's products read in place (models/decode_plan.py, cpu/csrc/qmatvec.h).

        Returns:
            (format, qweight, scales, group): the product's format (`cpu/decode.WEIGHT_FORMATS`: "int8" or "int4",
            "int8_a8" / "int4_a8" with int8 activations), the stored integer weights, the bf16 scales and int4's
            group size (0 for int8).
        """
        fmt = self.mode if self.activations == "float" else f"{self.mode}_a8"
        return fmt, self.qweight, self.scales, self.group_size or 0

    def stored_bytes(self) -> int:
        """Bytes of the integer weights and scales (and bias), what a decoded token reads."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.bias) if t is not None)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"mode={self.mode!r}{g}, compute={self.compute!r}"
                + (f", activations={self.activations!r}" if self.activations != "float" else ""))
