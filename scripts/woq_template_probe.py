"""Inductor's CPU weight-only int4 GEMM template against ATen's ``_weight_int4pack_mm_for_cpu`` (issue 48).

One linear layer of int4 weights (groups of 32, as the quantized target packs them) is compiled with
``max_autotune`` and freezing, once per row count M, with only the C++ template allowed
(``max_autotune_gemm_backends="CPP"``), and run eagerly on ATen's kernel. For each M it prints the
fastest of ``--repeats`` calls (thread CPU time), which micro-kernel inductor chose, and whether each
row equals that row computed alone (M = 1, ATen) bit for bit: the batch invariance an exact verify
needs. Where inductor has no template for a shape it says so.

    python scripts/woq_template_probe.py [--k 576] [--n 1536] [--rows 1,2,4,8,16] [--repeats 200]
"""

from __future__ import annotations

import argparse
import time

import torch

GROUP = 32


class Int4Linear(torch.nn.Module):
    """``x @ W.T`` on int4 weights packed for ATen's CPU kernel (frozen parameters, so inductor may prepack)."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(packed, requires_grad=False)  # [N, K / 2] uint8
        self.scales_zeros = torch.nn.Parameter(scales_zeros, requires_grad=False)  # [K / 32, N, 2] bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, K] bfloat16 -> [M, N]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, GROUP, self.scales_zeros)


def fastest(fn, x: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.thread_time_ns()
        fn(x)
        best = min(best, time.thread_time_ns() - began)
    return best / 1e3


def chosen_micro_kernels() -> list[str]:
    """Wrap inductor's micro-kernel factory to record the class it picks for each compile."""
    import torch._inductor.lowering  # noqa: F401 (loads the codegen modules in an order without cycles)
    from torch._inductor.codegen import cpp_gemm_template

    picked: list[str] = []
    create = cpp_gemm_template.create_micro_gemm

    def recording(*args, **kwargs):
        micro = create(*args, **kwargs)
        picked.append(type(micro).__name__ if micro is not None else "none")
        return micro

    cpp_gemm_template.create_micro_gemm = recording  # the template's own reference: the kernel it generates
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import torch._inductor.config as inductor

    inductor.freezing = True
    inductor.max_autotune = True
    inductor.max_autotune_gemm_backends = "CPP"
    inductor.fx_graph_cache = False  # generate each kernel anew, so the micro-kernel it picks is seen
    picked = chosen_micro_kernels()
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (args.n, args.k), generator=gen, dtype=torch.int32)  # [N, K]
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales = torch.rand(args.k // GROUP, args.n, generator=gen) * 0.02
    zeros = torch.randn(args.k // GROUP, args.n, generator=gen) * 0.01
    layer = Int4Linear(packed, torch.stack([scales, zeros], -1).bfloat16().contiguous()).eval()
    rows = torch.randn(max(int(m) for m in args.rows.split(",")), args.k, generator=gen).bfloat16()  # [M, K]
    with torch.no_grad():
        alone = torch.cat([layer(rows[i:i + 1]) for i in range(rows.shape[0])])  # each row by itself, ATen
        print(f"# K={args.k} N={args.n} groups of {GROUP}, 1 thread, {torch.__version__}, "
              f"CPU capability {torch.backends.cpu.get_cpu_capability()}; fastest of {args.repeats}, thread CPU time")
        print("M   aten_us  template_us  micro-kernel               rows == rows alone")
        for m in (int(v) for v in args.rows.split(",")):
            x = rows[:m].contiguous()
            aten = fastest(layer, x, args.repeats)
            torch._dynamo.reset()
            picked.clear()
            compiled = torch.compile(layer, dynamic=False)
            try:
                out = compiled(x)
            except Exception as exc:  # inductor found no template for this shape
                print(f"{m:<3} {aten:>8.1f}  {'-':>11}  no template ({type(exc).__name__})")
                continue
            template = fastest(compiled, x, args.repeats)
            kernel = picked[-1] if picked else "none"
            print(f"{m:<3} {aten:>8.1f}  {template:>11.1f}  {kernel:<26} {torch.equal(out.to(alone.dtype), alone[:m])}")


if __name__ == "__main__":
    main()
