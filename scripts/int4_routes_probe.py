"""Other CPU kernels for small-M quantized linear layers, beside ATen's int4 kernel (issue 48).

For M = 1, 2, 4, 8, 16 rows of one K x N layer, 20 distinct weights (streamed from memory, as a
forward's layers are), it prints each route's cost per layer (the fastest of ``--repeats`` passes over
the 20, thread CPU time) and whether rows computed together equal the same rows computed alone, bit
for bit, at widths 2, 3, 4, 5, 8 and 16 (the batch invariance an exact verify needs):

* ``aten int4``: ``torch._weight_int4pack_mm_for_cpu`` (groups of 32, bfloat16 activations), the
  quantized target's kernel;
* ``quantized int4 wrapper``: ``torch.ops.quantized.int4mm_packed_weight_cpu`` on the same packed
  weights (its results are compared with ATen's);
* ``fbgemm int8``: ``torch.ops.quantized.linear`` on per-channel int8 weights prepacked by
  ``quantized.linear_prepack`` (uint8 activation codes at scale 1; its output is requantized to
  uint8, so only its cost is of interest);
* ``onnxruntime MatMulNBits``: 4-bit weights in blocks of 32 with zero points, ``accuracy_level`` 0
  (float) and 4 (activations quantized to int8 per block, int8 dot products, as llama.cpp's Q8
  activations), one graph holding the 20 layers, one thread. Only where ``onnxruntime`` and ``onnx``
  import (they are not specgen dependencies: ``pip install onnxruntime onnx`` in a scratch venv).

    python scripts/int4_routes_probe.py [--k 576] [--n 1536] [--repeats 40]
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch

GROUP = 32
LAYERS = 20
ROWS = (1, 2, 4, 8, 16)
WIDTHS = (2, 3, 4, 5, 8, 16)


def per_layer_us(run, rows: dict, repeats: int) -> list[float]:
    """The fastest pass of ``run(x)`` (all LAYERS layers) per row count, in us per layer."""
    out = []
    for m in ROWS:
        x = rows[m]
        run(x)
        best = float("inf")
        for _ in range(repeats):
            began = time.thread_time_ns()
            run(x)
            best = min(best, time.thread_time_ns() - began)
        out.append(best / 1e3 / LAYERS)
    return out


def invariant(first, x) -> bool:
    """Whether ``first(x[:w])`` equals the rows of ``first`` on each row alone, at every width."""
    alone = torch.cat([torch.as_tensor(first(x[i:i + 1])) for i in range(x.shape[0])])
    return all(torch.equal(torch.as_tensor(first(x[:w])), alone[:w]) for w in WIDTHS)


def report(name: str, costs: list[float], same: bool | None) -> None:
    cells = " / ".join(f"{c:.1f}" for c in costs)
    print(f"{name:<34} us per layer at M = {'/'.join(map(str, ROWS))}: {cells}"
          + ("" if same is None else f"; rows together = rows alone: {'yes' if same else 'NO'}"))


def torch_routes(k: int, n: int, repeats: int, gen: torch.Generator) -> None:
    packed = [torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen), 1)
              for _ in range(LAYERS)]
    scales = (torch.rand(k // GROUP, n, 2, generator=gen) * 0.02).to(torch.bfloat16)  # [K/32, N, 2]
    rows = {m: torch.randn(m, k, generator=gen).to(torch.bfloat16) for m in ROWS}
    size = torch.tensor(GROUP)

    def aten(x):
        return [torch._weight_int4pack_mm_for_cpu(x, w, GROUP, scales) for w in packed]

    def wrapper(x):
        return [torch.ops.quantized.int4mm_packed_weight_cpu(x, w, size, scales) for w in packed]

    x16 = torch.randn(16, k, generator=gen).to(torch.bfloat16)
    report("aten int4", per_layer_us(aten, rows, repeats), invariant(lambda x: aten(x)[0], x16))
    same = torch.equal(aten(x16)[0], wrapper(x16)[0])
    report("quantized int4 wrapper", per_layer_us(wrapper, rows, repeats), invariant(lambda x: wrapper(x)[0], x16))
    print(f"{'':<34} its results equal aten int4's: {'yes' if same else 'NO'}")

    torch.backends.quantized.engine = "fbgemm"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated; this is what the route is
        weights = []
        for _ in range(LAYERS):
            w = torch.randn(n, k, generator=gen)
            scale = (w.abs().amax(1) / 127).double()
            qw = torch.quantize_per_channel(w, scale, torch.zeros(n, dtype=torch.long), 0, torch.qint8)
            weights.append(torch.ops.quantized.linear_prepack(qw, None))
        codes = {m: torch._make_per_tensor_quantized_tensor(torch.randint(0, 256, (m, k), dtype=torch.uint8,
                                                                          generator=gen), 1.0, 0) for m in ROWS}
        report("fbgemm int8 (uint8 output)",
               per_layer_us(lambda x: [torch.ops.quantized.linear(x, w, 1.0, 0) for w in weights], codes, repeats),
               None)


def onnx_routes(k: int, n: int, repeats: int) -> None:
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        print("onnxruntime MatMulNBits: skipped (onnxruntime and onnx do not import here)")
        return
    rng = np.random.default_rng(0)
    blocks = k // GROUP
    rows = {m: (rng.standard_normal((m, k)) * 0.05).astype(np.float32) for m in ROWS}
    x16 = (rng.standard_normal((16, k)) * 0.05).astype(np.float32)
    for level in (0, 4):
        inits, nodes = [], []
        for i in range(LAYERS):
            q = rng.integers(0, 16, size=(n, blocks, GROUP), dtype=np.uint8)
            zero = rng.integers(0, 16, size=(n, blocks), dtype=np.uint8)
            zeros = np.zeros((n, (blocks + 1) // 2), np.uint8)  # two 4-bit zero points a byte, low nibble first
            zeros[:, :blocks // 2] = zero[:, 0:blocks - blocks % 2:2] | (zero[:, 1::2][:, :blocks // 2] << 4)
            if blocks % 2:
                zeros[:, -1] = zero[:, -1]
            inits += [numpy_helper.from_array((q[:, :, 0::2] | (q[:, :, 1::2] << 4)).astype(np.uint8), f"B{i}"),
                      numpy_helper.from_array((rng.random(n * blocks) * 0.02 + 0.001).astype(np.float32), f"s{i}"),
                      numpy_helper.from_array(zeros.reshape(-1), f"z{i}")]
            nodes.append(helper.make_node("MatMulNBits", ["X", f"B{i}", f"s{i}", f"z{i}"], [f"Y{i}"],
                                          domain="com.microsoft", K=k, N=n, bits=4, block_size=GROUP,
                                          accuracy_level=level))
        graph = helper.make_graph(nodes, "layers", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", k])],
                                  [helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", n])
                                   for i in range(LAYERS)], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

        def run(x):
            return session.run(None, {"X": x})

        report(f"onnxruntime MatMulNBits, level {level}", per_layer_us(run, rows, repeats),
               invariant(lambda x: run(np.ascontiguousarray(np.asarray(x)))[0], torch.from_numpy(x16)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread, {LAYERS} distinct {args.k} -> {args.n} layers")
    torch_routes(args.k, args.n, args.repeats, torch.Generator().manual_seed(0))
    onnx_routes(args.k, args.n, args.repeats)


if __name__ == "__main__":
    main()
