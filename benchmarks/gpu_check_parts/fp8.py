"""Part j: FP8 (train.fp8: deepseek) on the GPU: the backend's blockwise FP8 GEMM (torch._scaled_mm,
1x128 x 128x128) against a bfloat16 matmul at DeepSeek-V3's shapes, TFLOP/s by the device's timer
(anchors, docs/fp8.md: torch's blockwise _scaled_mm 1,009 against bfloat16 608 on an H100, DeepGEMM
up to 1,426 on an H800, the FP8 peak 1,979); and the GPU's FP8 matmul against the emulation (the
conformance kit's bounds: SQNR >= 40 dB, calc_diff < 1e-4), dense and over 200 tokens (the weight
gradient's 1x128 x 128x1 form). Which path ran (blockwise or the emulation, and why) is recorded."""

from __future__ import annotations

from .common import Ctx, Record, cuda_reason, device_time

#: (M, K, N): DeepSeek-V3's expert projection over 4,096 tokens and its 7168 x 24576 query up-projection
SHAPES = [(4096, 7168, 2048), (4096, 7168, 24576)]
DRY_SHAPES = [(64, 384, 256)]


def part_fp8(rec: Record, ctx: Ctx) -> None:
    import torch

    from portapipe.backends import get_backend
    from portapipe.backends.fp8_mm import fp8_mm_emulated
    from portapipe.backends.scaled_mm import KIT_CALC_DIFF, KIT_SQNR_DB, calc_diff, sqnr_db
    from portapipe.fp8.quantize import quantize_blocks, quantize_rows

    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    be = get_backend(device)
    rec.put("path", be.fp8_path())
    dev = be.device()
    rows, agree = [], []
    for m, k, n in DRY_SHAPES if ctx.dry else SHAPES:
        g = torch.Generator().manual_seed(m + k + n)
        x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(dev, torch.bfloat16)
        xq, wq = quantize_rows(x), quantize_blocks(w)
        wt = wq.data.t(), wq.scale.t()
        reps = 2 if ctx.dry else 20
        fp8_s = device_time(be, lambda: be.fp8_mm(xq.data, xq.scale, wt[0], wt[1], torch.bfloat16), reps)
        bf16_s = device_time(be, lambda: x @ w.t(), reps)
        flops = 2.0 * m * k * n
        rows.append({"m": m, "k": k, "n": n, "fp8_s": fp8_s, "bf16_s": bf16_s, "fp8_tflops": flops / fp8_s / 1e12,
                     "bf16_tflops": flops / bf16_s / 1e12, "fp8_over_bf16": bf16_s / fp8_s})
        rec.put("gemm", rows)
        # against the emulation on 256 rows (the float64 block sums of the whole would take minutes)
        r = slice(0, min(m, 256))
        got = be.fp8_mm(xq.data[r], xq.scale[r], wt[0], wt[1], torch.float32).cpu()
        want = fp8_mm_emulated(xq.data[r].cpu(), xq.scale[r].cpu(), wt[0].cpu(), wt[1].cpu(), torch.float32)
        agree.append({"form": f"1x128 x 128x128, {min(m, 256)} x {k} x {n}", "sqnr_db": sqnr_db(got, want), "calc_diff": calc_diff(got, want)})
        # the weight gradient's form: 1x128 x 128x1 over 200 tokens (padded to 256 for the kernel)
        gt, xt = quantize_rows(x[:200, :256].t()), quantize_rows(x[:200, 256:512].t())
        got = be.fp8_mm(gt.data, gt.scale, xt.data.t(), xt.scale.t(), torch.float32).cpu()
        want = fp8_mm_emulated(gt.data.cpu(), gt.scale.cpu(), xt.data.t().cpu(), xt.scale.t().cpu(), torch.float32)
        form = f"1x128 x 128x1, {gt.data.shape[0]} x {gt.data.shape[1]} x {xt.data.shape[0]}"
        agree.append({"form": form, "sqnr_db": sqnr_db(got, want), "calc_diff": calc_diff(got, want)})
        rec.put("against_emulation", agree)
        if ctx.left() < 10:
            break
    within = all(a["sqnr_db"] >= KIT_SQNR_DB and a["calc_diff"] < KIT_CALC_DIFF for a in agree)
    rec.put("within_kit_bounds", within)
    rec["summary"] = "; ".join(f"{r['m']}x{r['k']}x{r['n']}: FP8 {r['fp8_tflops']:.0f} vs bf16 {r['bf16_tflops']:.0f} TFLOP/s" for r in rows)[:250] + (
        f"; vs emulation within bounds: {within}")
    rec["status"] = ("ok" if within else "failed") if device == "cuda" else ("dry" if ctx.dry else "skipped")
    if device == "cpu":
        rec["reason"] = reason or "dry mode"
